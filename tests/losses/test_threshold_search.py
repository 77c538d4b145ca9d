"""Constrained RLHF's threshold search (arXiv 2310.04373): the ask/tell Nelder-Mead against scipy's path and
hand-computed moves, convergence on closed-form functions, and the `lagrangian_search` controller and trainer.

Independent references: ``scipy.optimize.minimize(method="Nelder-Mead")`` (the evaluated points, in order, from the
same initial simplex), the moves of one iteration worked by hand, and the known minimisers of a quadratic bowl and of
Rosenbrock's function.
"""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_stable import StableGRPOConfig
from hf_stable.losses.lagrangian import PHASES, LagrangianSearchController, NelderMead, default_simplex
from hf_stable.losses.reward_control import REWARD_WEIGHTINGS


scipy_optimize = pytest.importorskip("scipy.optimize")


def rosenbrock(x) -> float:
    return float((1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2)


def bowl(x) -> float:
    centre = (0.3, -0.7, 1.2)
    return float(sum((i + 1) * (float(x[i]) - c) ** 2 for i, c in enumerate(centre)))


def scipy_points(fn, simplex, bounds=None, maxfev=300, x0=None):
    """The points scipy's Nelder-Mead evaluates, in order (``simplex=None``: its default simplex around ``x0``)."""
    calls = []

    def f(x):
        calls.append(np.array(x))
        return fn(x)

    options = {"maxfev": maxfev, "xatol": 1e-300, "fatol": 1e-300}
    if simplex is not None:
        options["initial_simplex"] = np.asarray(simplex, dtype=np.float64)
        x0 = options["initial_simplex"][0]
    scipy_optimize.minimize(f, x0, method="Nelder-Mead", bounds=bounds, options=options)
    return calls


def our_points(fn, search: NelderMead, count: int):
    points = []
    for _ in range(count):
        x = search.ask()
        points.append(x.numpy())
        search.tell(fn(x.numpy()))
    return points


def _bounds(bounds):
    return (None, None) if bounds is None else ([b[0] for b in bounds], [b[1] for b in bounds])


# ---------------------------------------------------------------------------------------------------------------------
# Nelder-Mead


@pytest.mark.parametrize(
    "fn, simplex, bounds",
    [
        (rosenbrock, [[-1.2, 1.0], [-1.14, 1.0], [-1.2, 1.05]], None),
        # the bounds clip the path (the optimum (1, 1) lies outside them)
        (rosenbrock, [[-1.2, 1.0], [-1.14, 1.0], [-1.2, 1.05]], [(-1.5, 0.9), (-0.5, 1.2)]),
        # vertices above the upper bound are reflected into the interior before the first evaluation
        (bowl, [[0.0, 0.0, 0.0], [2.5, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.5]], [(-2, 2), (-2, 2), (-2, 2)]),
    ],
)
def test_the_path_is_scipys_point_for_point(fn, simplex, bounds):
    expected = scipy_points(fn, simplex, bounds)
    ours = our_points(fn, NelderMead(torch.tensor(simplex, dtype=torch.float64), *_bounds(bounds)), len(expected))
    assert len(expected) == 300
    for i, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert np.array_equal(a, b), f"evaluation {i}: {a} vs scipy's {b}"


def test_default_simplex_is_scipys():
    """Without an initial simplex scipy moves each coordinate by 5 % (0.00025 where it is 0)."""
    x0 = np.array([0.4, 0.0, -2.0])
    expected = scipy_points(bowl, None, x0=x0, maxfev=120)
    ours = our_points(bowl, NelderMead(default_simplex(torch.tensor(x0))), len(expected))
    assert all(np.array_equal(a, b) for a, b in zip(ours, expected, strict=True))
    steps = default_simplex(torch.tensor([1.0, 2.0]), [0.5, None])
    assert steps.tolist() == [[1.0, 2.0], [1.5, 2.0], [1.0, 2.1]]


def _scripted(values):
    """A search on the unit simplex with the values of its three vertices told."""
    search = NelderMead(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    for v in values:
        search.tell(v)
    return search


def test_one_iteration_by_hand():
    # sorted vertices (0,0):0, (1,0):1, (0,1):2; centroid of the best two (0.5, 0); reflection 2·x̄ − (0,1) = (1, −1)
    search = _scripted([0.0, 1.0, 2.0])
    assert search.ask().tolist() == [1.0, -1.0] and PHASES[search.phase] == "reflect"

    # better than the best: expansion 3·x̄ − 2·(0,1) = (1.5, −2), kept when it beats the reflection
    search.tell(-1.0)
    assert search.ask().tolist() == [1.5, -2.0] and PHASES[search.phase] == "expand"
    search.tell(-2.0)
    assert search.sim.tolist() == [[1.5, -2.0], [0.0, 0.0], [1.0, 0.0]] and search.fsim.tolist() == [-2.0, 0.0, 1.0]
    # next reflection: centroid (0.75, −1), worst (1, 0) -> (0.5, −2)
    assert search.ask().tolist() == [0.5, -2.0]

    # an expansion no better than the reflection keeps the reflection
    search = _scripted([0.0, 1.0, 2.0])
    search.tell(-1.0)
    search.tell(0.0)
    assert search.sim.tolist() == [[1.0, -1.0], [0.0, 0.0], [1.0, 0.0]] and search.fsim.tolist() == [-1.0, 0.0, 1.0]

    # between the best and the second worst: the reflection replaces the worst vertex
    search = _scripted([0.0, 1.0, 2.0])
    search.tell(0.5)
    assert search.sim.tolist() == [[0.0, 0.0], [1.0, -1.0], [1.0, 0.0]]
    assert search.ask().tolist() == [0.0, -1.0]  # centroid (0.5, −0.5), worst (1, 0)

    # between the second worst and the worst: outside contraction 1.5·x̄ − 0.5·(0,1) = (0.75, −0.5)
    search = _scripted([0.0, 1.0, 2.0])
    search.tell(1.5)
    assert search.ask().tolist() == [0.75, -0.5] and PHASES[search.phase] == "contract_outside"
    search.tell(1.5)  # no worse than the reflection: kept
    assert search.sim.tolist() == [[0.0, 0.0], [1.0, 0.0], [0.75, -0.5]] and search.fsim.tolist() == [0.0, 1.0, 1.5]

    # worse than the worst: inside contraction 0.5·x̄ + 0.5·(0,1) = (0.25, 0.5); no better: shrink towards (0, 0)
    search = _scripted([0.0, 1.0, 2.0])
    search.tell(3.0)
    assert search.ask().tolist() == [0.25, 0.5] and PHASES[search.phase] == "contract_inside"
    search.tell(2.5)
    assert PHASES[search.phase] == "shrink"
    assert search.ask().tolist() == [0.5, 0.0]
    search.tell(0.7)
    assert search.ask().tolist() == [0.0, 0.5]
    search.tell(0.2)
    assert search.sim.tolist() == [[0.0, 0.0], [0.0, 0.5], [0.5, 0.0]] and search.fsim.tolist() == [0.0, 0.2, 0.7]
    assert search.iterations == 1 and search.evaluations == 7  # 3 vertices, reflection, contraction, 2


@pytest.mark.parametrize(
    "fn, x0, optimum, evaluations",
    [(bowl, [0.0, 0.0, 0.0], [0.3, -0.7, 1.2], 400), (rosenbrock, [-1.2, 1.0], [1.0, 1.0], 400)],
)
def test_converges_to_the_known_minimiser(fn, x0, optimum, evaluations):
    search = NelderMead(default_simplex(torch.tensor(x0, dtype=torch.float64)), xatol=1e-8, fatol=1e-12)
    for _ in range(evaluations):
        if search.done:
            break
        search.tell(fn(search.ask().numpy()))
    assert search.done
    best, value = search.best()
    assert torch.allclose(best, torch.tensor(optimum, dtype=torch.float64), atol=1e-6)
    assert value < 1e-11
    assert torch.equal(search.ask(), best)  # once done it proposes its best point
    evaluations = search.evaluations
    search.tell(5.0)
    assert search.evaluations == evaluations  # and takes no more values


def test_nan_values_count_as_the_worst_and_points_stay_finite():
    search = NelderMead(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), low=[-1.0, -1.0], high=[1.0, 1.0])
    values = iter([math.nan, 1.0, 2.0] + [math.nan] * 40)
    for v in values:
        assert torch.isfinite(search.ask()).all()
        search.tell(v)
    assert torch.isfinite(search.sim).all()
    assert ((search.sim >= -1) & (search.sim <= 1)).all()
    with pytest.raises(ValueError, match="shape"):
        NelderMead(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="bounds"):
        NelderMead(torch.zeros(2, 1), low=[1.0], high=[0.0])


def test_state_round_trip_through_safetensors_gives_the_same_path(tmp_path):
    search = NelderMead(default_simplex(torch.tensor([-1.2, 1.0], dtype=torch.float64)))
    our_points(rosenbrock, search, 23)  # stops mid-iteration
    save_file(search.state_dict(), str(tmp_path / "s.safetensors"))
    resumed = NelderMead(torch.zeros(3, 2))
    resumed.load_state_dict(load_file(str(tmp_path / "s.safetensors")))
    assert PHASES[resumed.phase] == PHASES[search.phase]
    a, b = our_points(rosenbrock, search, 60), our_points(rosenbrock, resumed, 60)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="searches 3 thresholds"):
        NelderMead(torch.zeros(4, 3)).load_state_dict(search.state_dict())


# ---------------------------------------------------------------------------------------------------------------------
# The controller


def _controller(**params) -> LagrangianSearchController:
    params = {"thresholds": [None, 0.2, None], "objective": 2, "step": [None, 0.1, None], **params}
    return REWARD_WEIGHTINGS.get("lagrangian_search")(torch.tensor([1.0, 1.0, 0.0]), **params)


def _held_out(threshold: float) -> float:
    """A scripted held-out score: best when the proxy's threshold is 0.43 (the proxy's overoptimization point)."""
    return 1.0 - (threshold - 0.43) ** 2


def _drive(controller, validations: int, score=_held_out) -> list[float]:
    """Feed validation means whose held-out column is ``score(current threshold)``; returns the thresholds used."""
    if controller.reference is None:
        controller.validation_point(torch.tensor([0.0, 0.0, 0.0]))
    used = []
    for _ in range(validations):
        threshold = float(controller.thresholds[1])
        used.append(threshold)
        controller.validation_point(torch.tensor([0.1, -0.3, score(threshold)]))
    return used


def test_controller_follows_scipys_path_to_the_held_out_optimum():
    controller = _controller()
    used = _drive(controller, 40)
    # scipy on minus the held-out score from the same simplex; thresholds and validation means are float32 tensors
    expected = scipy_points(
        lambda x: -float(np.float32(_held_out(float(np.float32(x[0]))))), [[0.2], [0.2 + 0.1]], maxfev=40
    )
    assert used == [float(np.float32(x[0])) for x in expected]
    assert abs(used[-1] - 0.43) < 1e-4
    assert controller.thresholds[0].isnan() and controller.thresholds[2].isnan()
    assert torch.equal(controller.weights, torch.tensor([1.0, 1.0, 0.0]))  # no observe yet: μ = 0


def test_controller_holds_each_proposal_for_its_period():
    once, twice = _controller(), _controller(period=2)
    used_once = _drive(once, 12)
    used_twice = _drive(twice, 24)
    assert used_twice == [t for t in used_once for _ in range(2)]


def test_controller_stops_at_xtol_and_holds_the_best():
    controller = _controller(xtol=1e-3)
    used = _drive(controller, 60)
    assert controller.search.done
    assert used[-1] == used[-2] == pytest.approx(0.43, abs=2e-3)


def test_controller_bounds_clip_the_proposals():
    controller = _controller(low=[None, 0.15, None], high=[None, 0.35, None])
    used = _drive(controller, 20)
    assert min(used) >= 0.15 - 1e-7 and max(used) <= 0.35 + 1e-7
    assert max(used) == pytest.approx(0.35)  # the optimum 0.43 lies beyond the upper bound


def test_controller_state_round_trip_gives_the_same_proposals(tmp_path):
    trained = _controller()
    _drive(trained, 7)
    rewards = torch.tensor([[1.0, 0.9, 0.5], [0.0, 0.8, 0.2]])  # the proxy's mean 0.85 exceeds its threshold
    trained.observe(rewards, torch.zeros(2), 2, None)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "c.safetensors"))
    fresh = _controller()
    fresh.load_state_dict(load_file(str(tmp_path / "c.safetensors")))
    assert torch.allclose(fresh.thresholds, trained.thresholds, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(fresh.weights, trained.weights) and not torch.equal(trained.weights, trained.base)
    assert torch.equal(fresh.reference, trained.reference)
    assert _drive(fresh, 15) == _drive(trained, 15)


def test_controller_degenerate_scores_stay_finite():
    controller = _controller(low=[None, -1.0, None], high=[None, 1.0, None])
    used = _drive(controller, 15, score=lambda t: math.nan)
    assert all(math.isfinite(t) and -1.0 <= t <= 1.0 for t in used)
    controller = _controller(thresholds=[None, 0.0, None], step=None)  # scipy's edge at 0: 0.00025
    assert _drive(controller, 2) == [0.0, pytest.approx(0.00025)]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"objective": None}, "lagrange_search_objective"),
        ({"objective": 3}, "lagrange_search_objective"),
        ({"objective": 0}, "lagrange_search_objective"),  # trained on (weight 1)
        ({"thresholds": [None, 0.2, 0.5]}, "lagrange_search_objective"),  # the held-out reward is constrained
        ({"thresholds": [None, None, None]}, "lagrange_thresholds"),  # nothing to search
        ({"thresholds": [None, 0.2]}, "lagrange_thresholds"),
        ({"low": [None, 0.3, None]}, "lagrange_thresholds"),  # the start lies below the lower bound
        ({"high": [None, 0.1]}, "lagrange_search_high"),
        ({"step": [0.1]}, "lagrange_search_step"),
    ],
)
def test_controller_refuses_by_name(params, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        _controller(**params)


@pytest.mark.parametrize(
    "field, value",
    [
        ("lagrange_search_objective", None),  # required
        ("lagrange_thresholds", None),
        ("lagrange_thresholds", [None, None, None]),  # nothing to search
        ("lagrange_search_objective", -1),
        ("lagrange_search_objective", 1.5),
        ("lagrange_search_low", [None, "a"]),
        ("lagrange_search_high", 0.3),
        ("lagrange_search_step", [None, 0.0]),
        ("lagrange_search_step", [None, math.inf]),
        ("lagrange_search_period", 0),
        ("lagrange_search_eval_every", 0),
        ("lagrange_search_val_size", 0),
        ("lagrange_search_xtol", -1.0),
    ],
)
def test_config_refuses_bad_fields_at_construction(tmp_path, field, value):
    def build(**changes):
        values = {"lagrange_thresholds": [None, 0.2, None], "lagrange_search_objective": 2, **changes}
        return StableGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, reward_weighting="lagrangian_search", **values
        )

    with pytest.raises(ValueError, match=f"`{field}`|{field}="):
        build(**{field: value})
    assert build().lagrange_search_objective == 2  # the same config without the bad value is accepted


# ---------------------------------------------------------------------------------------------------------------------
# In the trainer


class HeldOut:
    """A held-out reward (weight 0): the completion's length distance from 3 characters, scored, never trained on."""

    __name__ = "held_out"

    def __call__(self, completions, **kwargs):
        return [-abs(len(c) - 3) / 3 for c in completions]


SEARCH = dict(
    reward_weights=[1.0, 1.0, 0.0],
    reward_weighting="lagrangian_search",
    lagrange_thresholds=[None, -0.5, None],
    lagrange_lr=1.0,
    lagrange_search_objective=2,
    lagrange_search_step=[None, 0.2, None],
    lagrange_search_val_size=4,
)


def _record(monkeypatch):
    """Record the thresholds of each generation and the held-out validation means."""
    seen = {"thresholds": [], "scores": []}
    observe, validation_point = LagrangianSearchController.observe, LagrangianSearchController.validation_point

    def observing(self, *args):
        seen["thresholds"].append(float(self.thresholds[1]))
        return observe(self, *args)

    def validating(self, means):
        seen["scores"].append(float(means[2]))
        return validation_point(self, means)

    monkeypatch.setattr(LagrangianSearchController, "observe", observing)
    monkeypatch.setattr(LagrangianSearchController, "validation_point", validating)
    return seen


@pytest.mark.slow
def test_trainer_moves_the_thresholds_along_the_search(tmp_path, monkeypatch):
    from grpo_helpers import grpo_run, length_reward

    from hf_stable.testing import arithmetic_reward

    seen = _record(monkeypatch)
    steps = 5
    _, trainer = grpo_run(
        tmp_path, reward_funcs=(arithmetic_reward, length_reward, HeldOut()), max_steps=steps, **SEARCH
    )
    # the reference validation, then one per step; the thresholds of step s are the proposal after s-1 validations
    assert len(seen["scores"]) == steps + 1 and len(seen["thresholds"]) == steps
    replay = iter(seen["scores"][1:])
    expected = scipy_points(lambda x: -next(replay), [[-0.5], [-0.3]], maxfev=steps - 1)
    assert seen["thresholds"][: steps - 1] == [float(np.float32(x[0])) for x in expected]
    assert len(set(seen["thresholds"])) >= 3  # the thresholds changed during training
    assert trainer._controller.search.evaluations == steps
    logged = [h for h in trainer.state.log_history if "stable/grpo/lagrangian_search/threshold_1" in h]
    assert logged and all("stable/grpo/lagrangian/mu_1" in h for h in trainer.state.log_history if "loss" in h)


@pytest.mark.slow
def test_trainer_resume_continues_the_search_exactly(tmp_path):
    from grpo_helpers import grpo_run, length_reward

    from hf_stable.testing import arithmetic_reward

    funcs = (arithmetic_reward, length_reward, HeldOut())
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, **SEARCH)
    _, full = grpo_run(tmp_path / "full", reward_funcs=funcs, **settings)
    grpo_run(tmp_path / "cut", reward_funcs=funcs, **{**settings, "max_steps": 2})
    resumed = _resume(tmp_path / "cut", funcs, settings)
    for name, p in full.model.named_parameters():
        assert torch.equal(p, dict(resumed.model.named_parameters())[name]), name
    a, b = full._controller.state_dict(), resumed._controller.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full._controller.search.evaluations == 4


def _resume(output_dir, funcs, settings):
    from grpo_helpers import GRPO_ARGS, G, deterministic_rollout

    from hf_stable import StableGRPOTrainer
    from hf_stable.testing import arithmetic_dataset, build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    args = StableGRPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=2 * G, **{**GRPO_ARGS, **settings}
    )
    trainer = StableGRPOTrainer(
        model=model,
        reward_funcs=list(funcs),
        args=args,
        train_dataset=arithmetic_dataset(16, seed=0, max_operand=9),
        processing_class=tokenizer,
        rollout_func=deterministic_rollout,
    )
    trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    return trainer

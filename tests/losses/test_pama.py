"""PAMA (arXiv 2508.07768) as `reward_weighting="pama"`: the statistics against a loop over groups, the closed form
against a numerical solution of the same convex problem and against MGDA's min-norm point on explicit gradients,
the invariances, the degenerate batches, the controller's state and refusals, and a trainer run."""

import itertools
import math
import statistics as pystats

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_stable import StableGRPOConfig
from hf_stable.losses.pama import PAMA_PAPER, pama_min_norm, pama_statistics, pama_weights
from hf_stable.losses.reward_control import REWARD_WEIGHTINGS, StepContext


_CTX = StepContext(0, 1e-2, lambda: torch.zeros(0))


# ---------------------------------------------------------------------------------------------------------------------
# independent references


def _loop_statistics(rows, g, b, positive_part, scale):
    """`c_k` by plain Python over groups: centre each group's valid values of `b_k r_k` (and divide by their sample
    std + 1e-4 for 'group', TRL's z-score), clip at 0 for the positive part, average the squares over the valid
    entries."""
    k = len(rows[0])
    out = []
    for j in range(k):
        total, count = 0.0, 0
        for start in range(0, len(rows), g):
            values = [b[j] * row[j] for row in rows[start : start + g] if not math.isnan(row[j])]
            count += len(values)
            if len(values) < 2 or max(values) == min(values):
                continue
            mean = pystats.fmean(values)
            for v in values:
                a = v - mean
                if scale == "group":
                    a /= pystats.stdev(values) + 1e-4
                total += max(a, 0.0) ** 2 if positive_part else a * a
        out.append(total / count if count else 0.0)
    return out


def _project_simplex(v):
    """Euclidean projection onto the probability simplex (sort-based, Held et al. 1974 / Duchi et al. 2008)."""
    u = sorted(v, reverse=True)
    cumulative, theta = 0.0, 0.0
    for i, x in enumerate(u, start=1):
        cumulative += x
        t = (cumulative - 1.0) / i
        if x - t > 0:
            theta = t
    return [max(x - theta, 0.0) for x in v]


def _min_norm_numerically(gram, iterations=200000):
    """`argmin_{α ∈ Δ} αᵀ M α` by projected gradient descent in Python floats (step 1/(2·λ_max)), until a step moves
    α by less than 1e-14."""
    m = torch.as_tensor(gram, dtype=torch.float64)
    step = 1.0 / (2 * torch.linalg.eigvalsh(m).max().item())
    m = m.tolist()
    alpha = [1.0 / len(m)] * len(m)
    for _ in range(iterations):
        gradient = [2 * sum(row[j] * alpha[j] for j in range(len(alpha))) for row in m]
        new = _project_simplex([a - step * g for a, g in zip(alpha, gradient, strict=True)])
        done = max(abs(a - b) for a, b in zip(new, alpha, strict=True)) < 1e-14
        alpha = new
        if done:
            break
    return torch.tensor(alpha, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------------
# the closed form


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1e-2, 1e2), min_size=1, max_size=6))
def test_closed_form_is_the_minimiser_of_the_convex_problem(c):
    alpha = pama_weights(torch.tensor(c)).double()
    numeric = _min_norm_numerically(torch.diag(torch.tensor(c, dtype=torch.float64)))
    objective = lambda a: float((torch.tensor(c, dtype=torch.float64) * a.pow(2)).sum())  # noqa: E731
    assert alpha.min() >= 0 and alpha.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert objective(alpha) <= objective(numeric) * (1 + 1e-6)
    torch.testing.assert_close(alpha, numeric, rtol=0, atol=2e-4)
    assert pama_min_norm(torch.tensor(c), alpha.float()) == pytest.approx(1 / sum(1 / x for x in c), rel=1e-5)


def test_closed_form_beats_every_point_of_a_fine_simplex_grid():
    c = torch.tensor([0.3, 2.0, 0.05], dtype=torch.float64)
    alpha = pama_weights(c.float()).double()
    best = min(
        float((c * torch.tensor([i, j, 200 - i - j], dtype=torch.float64).div(200).pow(2)).sum())
        for i, j in itertools.product(range(201), repeat=2)
        if i + j <= 200
    )
    assert float((c * alpha.pow(2)).sum()) <= best + 1e-9
    # worked by hand: α ∝ (1/0.3, 1/2, 1/0.05) = (10/3, 1/2, 20) / (143/6)
    by_hand = torch.tensor([20 / 143, 3 / 143, 120 / 143], dtype=torch.float64)
    torch.testing.assert_close(alpha, by_hand, rtol=1e-6, atol=0)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 4),
    st.lists(st.floats(-5, 5), min_size=48, max_size=48),
    st.booleans(),
    st.sampled_from(["reward", "group"]),
)
def test_with_orthogonal_advantage_columns_the_closed_form_is_mgdas_min_norm_point(k, values, positive_part, scale):
    """Objective j varies only in groups assigned to it, so the advantage columns are orthogonal. With orthonormal
    per-completion scores (`∇log π(y_n) = e_n`), `∇J_k = A_{:,k} / N` explicitly; MGDA's min-norm point over those
    gradients, found numerically, is the closed form, and the combined direction gives every objective the same
    first-order gain `⟨d, ∇J_k⟩ = ‖d‖²`."""
    g, groups = 4, 6
    rewards = torch.zeros(groups * g, k, dtype=torch.float64)
    flat = torch.tensor(values, dtype=torch.float64).reshape(groups, g, 2)
    for group in range(groups):
        owner = group % k
        rewards[group * g : (group + 1) * g, owner] = flat[group, :, 0] + 3 * flat[group, :, 1]
    c = pama_statistics(rewards.float(), g, positive_part=positive_part, scale=scale)
    # an objective without signal: MGDA's answer is the zero direction (left out by design, tested below)
    assume(bool((c > 1e-3).all()))
    alpha = pama_weights(c).double()
    advantages = torch.tensor(
        [_loop_advantages(rewards[:, j].tolist(), g, positive_part, scale) for j in range(k)], dtype=torch.float64
    )  # (K, N)
    grads = advantages / rewards.shape[0]
    gram = grads @ grads.T
    assert torch.allclose(gram, torch.diag(torch.diag(gram)), atol=1e-12)  # orthogonal by construction
    torch.testing.assert_close(alpha, _min_norm_numerically(gram), rtol=0, atol=5e-4)
    direction = alpha @ grads
    gains = grads @ direction
    torch.testing.assert_close(gains, torch.full_like(gains, direction.dot(direction).item()), rtol=1e-4, atol=1e-12)


def _loop_advantages(column, g, positive_part, scale):
    out = []
    for start in range(0, len(column), g):
        values = column[start : start + g]
        flat = max(values) == min(values)
        mean = pystats.fmean(values)
        for v in values:
            a = 0.0 if flat else (v - mean) / (pystats.stdev(values) + 1e-4 if scale == "group" else 1.0)
            out.append(max(a, 0.0) if positive_part else a)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the statistics


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.data(),
    st.booleans(),
    st.sampled_from(["reward", "group"]),
)
def test_statistics_match_a_loop_over_groups(g, k, groups, data, positive_part, scale):
    n = g * groups
    cell = st.one_of(st.floats(-10, 10), st.sampled_from([0.0, 1.0, math.nan]))
    rows = [[data.draw(cell) for _ in range(k)] for _ in range(n)]
    b = [data.draw(st.sampled_from([1.0, 0.5, -2.0, 0.0])) for _ in range(k)]
    got = pama_statistics(torch.tensor(rows), g, torch.tensor(b), positive_part, scale)
    expected = _loop_statistics(torch.tensor(rows).tolist(), g, b, positive_part, scale)
    assert torch.isfinite(got).all() and (got >= 0).all()
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(-12, 12), min_size=24, max_size=24),
    st.floats(0.1, 10),
    st.floats(-5, 5),
    st.permutations([0, 1, 2]),
)
def test_invariances(values, s, shift, order):
    """Permuting the objectives permutes the weights; a common positive scale of the rewards and a shift of any reward
    leave them unchanged; under `pama_scale='group'` a per-reward scale does too (up to TRL's 1e-4 in the std; the
    rewards are multiples of 1/4, so a group with spread has a std of at least 0.18), while under 'reward' scaling
    reward j by s multiplies its statistic by s² exactly."""
    r = torch.tensor(values, dtype=torch.float32).reshape(8, 3) / 4
    base = pama_weights(pama_statistics(r, 4))
    if base.sum() == 0:
        return
    permuted = pama_weights(pama_statistics(r[:, order], 4))
    torch.testing.assert_close(permuted, base[order], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(pama_weights(pama_statistics(s * r, 4)), base, rtol=1e-4, atol=1e-6)
    shifted = r + torch.tensor([shift, 0.0, -shift])
    torch.testing.assert_close(pama_weights(pama_statistics(shifted, 4)), base, rtol=1e-4, atol=1e-6)
    per_reward = r * torch.tensor([s, 1.0, 1.0])
    group = pama_weights(pama_statistics(r, 4, scale="group"))
    group_scaled = pama_weights(pama_statistics(per_reward, 4, scale="group"))
    torch.testing.assert_close(group_scaled, group, rtol=1e-2, atol=1e-4)
    c, c_scaled = pama_statistics(r, 4), pama_statistics(per_reward, 4)
    torch.testing.assert_close(c_scaled, c * torch.tensor([s * s, 1.0, 1.0]), rtol=1e-4, atol=1e-7)


def test_the_positive_part_and_the_scale_change_the_statistics():
    # one group of 4: reward 0 is right-skewed (one high outlier), reward 1 is 10x its mirror image
    r = torch.tensor([[0.0, 0.0], [0.0, -10.0], [0.0, -10.0], [4.0, -10.0]])
    # centred: r0 → (-1, -1, -1, 3), r1 → (7.5, -2.5, -2.5, -2.5)
    assert pama_statistics(r, 4, positive_part=False).tolist() == [3.0, 75.0 / 4]
    assert pama_statistics(r, 4, positive_part=True).tolist() == [9 / 4, 56.25 / 4]
    sd0, sd1 = math.sqrt(12 / 3) + 1e-4, math.sqrt(75 / 3) + 1e-4  # TRL's z-score: std + 1e-4
    expected = torch.tensor([9 / sd0**2 / 4, 56.25 / sd1**2 / 4])  # the same shape: equal up to the 1e-4
    torch.testing.assert_close(pama_statistics(r, 4, scale="group"), expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# degenerate batches


@pytest.mark.parametrize(
    "rewards, g",
    [
        (torch.full((8, 2), 3.0), 4),  # equal rewards
        (torch.full((8, 2), 1e8), 4),  # equal and large: exactly zero, no rounding residue
        (torch.randn(8, 2), 1),  # groups of one
        (torch.full((8, 2), math.nan), 4),  # no reward applies
    ],
)
def test_flat_batches_give_zero_statistics_and_keep_the_weights(rewards, g):
    c = pama_statistics(rewards, g)
    assert c.tolist() == [0.0, 0.0]
    assert pama_weights(c).tolist() == [0.0, 0.0] and pama_min_norm(c, pama_weights(c)) == 0.0
    controller = REWARD_WEIGHTINGS.get("pama")(torch.tensor([1.0, 0.5]))
    metrics = controller.observe(rewards, torch.zeros(len(rewards)), g, _CTX)
    assert controller.weights.tolist() == [1.0, 0.5] and all(math.isfinite(v) for v in metrics.values())


def test_one_objective_and_a_flat_objective():
    r = torch.tensor([[1.0], [0.0], [2.0], [0.5]])
    assert pama_weights(pama_statistics(r, 4)).tolist() == [1.0]
    controller = REWARD_WEIGHTINGS.get("pama")(torch.tensor([2.0]))
    controller.observe(r, torch.zeros(4), 4, _CTX)
    assert controller.weights.tolist() == [2.0]
    # a constant second reward has no gradient: it is left out and the first one gets all the weight
    two = torch.cat([r, torch.full((4, 1), 7.0)], dim=1)
    assert pama_weights(pama_statistics(two, 4)).tolist() == [1.0, 0.0]


def test_weights_refuse_negative_or_non_finite_statistics():
    for bad in ([1.0, -1.0], [1.0, math.nan], [math.inf, 1.0]):
        with pytest.raises(ValueError, match="PAMA statistics"):
            pama_weights(torch.tensor(bad))


# ---------------------------------------------------------------------------------------------------------------------
# the controller


def _batches(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 2, generator=generator) * torch.tensor([1.0, 3.0]) for _ in range(3)]


def test_controller_weights_are_k_alpha_times_base_with_the_ema_of_the_statistics():
    base = torch.tensor([1.0, -0.5])
    controller = REWARD_WEIGHTINGS.get("pama")(base, positive_part=False, ema=0.25)
    assert controller.weights.tolist() == base.tolist()  # uniform α before the first batch: the static weights
    ema = None
    for rewards in _batches():
        controller.observe(rewards, torch.zeros(8), 4, _CTX)
        c = pama_statistics(rewards, 4, base, positive_part=False)
        ema = c if ema is None else 0.75 * ema + 0.25 * c
        torch.testing.assert_close(controller.weights, 2 * pama_weights(ema) * base)
    assert not torch.allclose(controller.weights, base)


def test_controller_state_round_trip_is_exact(tmp_path):
    trained = REWARD_WEIGHTINGS.get("pama")(torch.tensor([1.0, 0.5]), ema=0.5)
    for rewards in _batches():
        trained.observe(rewards, torch.zeros(8), 4, _CTX)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "state.safetensors"))
    fresh = REWARD_WEIGHTINGS.get("pama")(torch.tensor([1.0, 0.5]), ema=0.5)
    fresh.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
    assert torch.equal(fresh.weights, trained.weights) and torch.equal(fresh.statistics, trained.statistics)
    more = _batches(seed=1)[0]
    assert trained.observe(more, torch.zeros(8), 4, _CTX) == fresh.observe(more, torch.zeros(8), 4, _CTX)
    assert torch.equal(fresh.weights, trained.weights)


@pytest.mark.parametrize(
    "field, value",
    [("pama_scale", "std"), ("pama_ema", 0.0), ("pama_ema", 1.5), ("pama_positive_part", "yes")],
)
def test_bad_fields_are_refused_by_name(tmp_path, field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        StableGRPOConfig(str(tmp_path), reward_weighting="pama", use_cpu=True, report_to="none", **{field: value})


def test_listed_with_its_paper():
    method = REWARD_WEIGHTINGS.get("pama")
    assert method.paper is PAMA_PAPER and PAMA_PAPER.url == "https://arxiv.org/abs/2508.07768"
    assert {f.name for f in method.fields} == {"pama_positive_part", "pama_scale", "pama_ema"}


# ---------------------------------------------------------------------------------------------------------------------
# in the trainer


@pytest.mark.slow
def test_trainer_uses_the_pama_weights_and_they_change_the_update(tmp_path):
    from grpo_helpers import grpo_run

    pama, trainer = grpo_run(tmp_path / "pama", reward_weighting="pama", max_steps=3)
    static, _ = grpo_run(tmp_path / "static", max_steps=3)
    controller = trainer._controller
    rewards = torch.stack([torch.tensor(list(v)) for v in trainer._logs["rewards"].values()], dim=1)[-8:]
    # the last generation batch's statistics (ema=1) set the weights
    torch.testing.assert_close(controller.statistics, pama_statistics(rewards, 4, torch.ones(2)))
    torch.testing.assert_close(controller.weights, 2 * pama_weights(controller.statistics))
    assert not torch.allclose(controller.weights, torch.ones(2))
    logged = [log for log in trainer.state.log_history if "stable/grpo/pama/min_norm" in log]
    assert logged and all(math.isfinite(log["stable/grpo/pama/min_norm"]) for log in logged)
    assert torch.isfinite(pama).all() and not torch.equal(pama, static)


@pytest.mark.slow
def test_resume_restores_the_pama_state_exactly(tmp_path):
    """Four steps straight vs two steps, a checkpoint, and two resumed steps: same parameters, same controller state
    (the EMA makes the weights depend on every batch seen before the checkpoint)."""
    from grpo_helpers import G, grpo_run, grpo_trainer

    config = {
        "reward_weighting": "pama",
        "pama_ema": 0.5,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "optim": "adamw_torch",
        "save_strategy": "steps",
        "save_steps": 2,
    }
    _, full = grpo_run(tmp_path / "full", batch_size=2 * G, **config)
    resumed = grpo_trainer(tmp_path / "full", batch_size=2 * G, **config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.equal(resumed._controller.statistics, full._controller.statistics)
    assert torch.equal(resumed._controller.weights, full._controller.weights)
    assert not torch.allclose(full._controller.weights, torch.ones(2))

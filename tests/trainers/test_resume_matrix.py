"""Resume matrix: for each trainer and each stateful callback or option, a run killed right after its checkpoint at
step N/2 and resumed with `train(resume_from_checkpoint=...)` ends *bitwise* equal to the uninterrupted run: the same
final parameters, the same logged metrics at every step after the checkpoint, the same merged folders.

The kill is emulated without a second process: when the uninterrupted run finishes saving `checkpoint-N/2` (every
callback's `on_save` included), its whole `output_dir` is copied to a fresh folder, exactly what a process killed at
that instant would leave on disk (nothing the run writes later reaches the copy). A fresh trainer resumes in the copy.

The stability guard and `ComponentClipCallback` cells live with the guard's tests (tests/callbacks/), not here.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback


N = 4  # optimizer steps; the checkpoint is at N // 2
HALF = N // 2
TIMING = ("step_time",)  # wall-clock metrics


class CopyAfterSave(TrainerCallback):
    """Added last: once `checkpoint-<step>` is complete, copy `output_dir` to `dest` (what a kill leaves)."""

    def __init__(self, step: int, dest: str):
        self.step, self.dest = step, dest

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            shutil.copytree(args.output_dir, self.dest)


def _after_checkpoint(log_history, half=HALF) -> list[dict]:
    """The log entries of the steps after the checkpoint, without the end-of-training summary (its runtime, and its
    `train_loss`, which transformers averages over the steps of this `train()` call only)."""
    entries = [h for h in log_history if h["step"] > half and "train_runtime" not in h]
    return [{k: v for k, v in h.items() if k not in TIMING} for h in entries]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _folder_weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def check_resume(tmp_path, build, artifacts=(), expect_metrics=(), half=HALF):
    """`build(output_dir)` returns a fresh trainer that saves every `half` steps. Runs N steps uninterrupted, resumes
    a copy of the output folder from checkpoint-`half`, and asserts bitwise equality; returns the two trainers."""
    full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
    full = build(full_dir)
    full.add_callback(CopyAfterSave(half, cut_dir))
    full.train()
    assert os.path.isdir(os.path.join(cut_dir, f"checkpoint-{half}")), f"the run did not save at step {half}"
    resumed = build(cut_dir)
    resumed.train(resume_from_checkpoint=os.path.join(cut_dir, f"checkpoint-{half}"))
    assert resumed.state.global_step == full.state.global_step

    problems = []
    full_params = dict(full.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        q = full_params[name]
        if not torch.equal(p.detach(), q.detach()):
            problems.append(f"param {name}: max |Δ| {(p.detach() - q.detach()).abs().max().item():.3e}")
    logs_full = _after_checkpoint(full.state.log_history, half)
    logs_resumed = _after_checkpoint(resumed.state.log_history, half)
    assert [h["step"] for h in logs_full] == [h["step"] for h in logs_resumed]
    for a, b in zip(logs_full, logs_resumed, strict=True):
        for key in sorted(set(a) | set(b)):
            if not _same(a.get(key), b.get(key)):
                delta = (
                    abs(a[key] - b[key])
                    if isinstance(a.get(key), float) and isinstance(b.get(key), float)
                    else "missing"
                )
                problems.append(f"step {a['step']} {key}: {a.get(key)!r} vs {b.get(key)!r} (|Δ| {delta})")
    for sub in artifacts:
        wa, wb = _folder_weights(os.path.join(full_dir, sub)), _folder_weights(os.path.join(cut_dir, sub))
        assert wa.keys() == wb.keys()
        for name in wa:
            if not torch.equal(wa[name], wb[name]):
                problems.append(f"{sub}/{name}: max |Δ| {(wa[name] - wb[name]).abs().max().item():.3e}")
    logged = {k for h in logs_full for k in h}
    missing = [m for m in expect_metrics if not any(k.startswith(m) for k in logged)]
    assert not missing, f"the cell logs none of {missing}: the option under test did not act"
    assert not problems, "resume differs from the uninterrupted run:\n" + "\n".join(problems[:20])
    return full, resumed


# ---------------------------------------------------------------------------------------------------------------------
# StableSFTTrainer


def _sft_builder(callbacks=(), **config):
    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import arithmetic_dataset, build_tiny_model

    def build(output_dir):
        model, tokenizer = build_tiny_model(seed=0)
        args = StableSFTConfig(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            max_steps=N,
            learning_rate=1e-2,
            optim="adamw_torch",
            lr_scheduler_type="constant",
            save_strategy="steps",
            save_steps=HALF,
            logging_steps=1,
            report_to="none",
            use_cpu=True,
            bf16=False,
            max_length=32,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            **config,
        )
        return StableSFTTrainer(
            model=model,
            args=args,
            train_dataset=arithmetic_dataset(12, seed=3),  # 3 steps per epoch: the run crosses an epoch
            processing_class=tokenizer,
            callbacks=[factory() for factory in callbacks],
        )

    return build


def _probe_texts():
    return [f"{a}+{b}={a + b}" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 9), (2, 7))]


def _wsm(**kwargs):
    from hf_stable.callbacks import WSMCallback

    return lambda: WSMCallback(interval_steps=1, num_intervals=2, **kwargs)


def _srank():
    from hf_stable.callbacks import StableRankMonitorCallback

    # exact_below=8: the tiny matrices go through warm-started power iterations, whose vectors are state
    return StableRankMonitorCallback(every=1, exact_below=8, power_iters=2)


def _msign():
    from hf_stable.callbacks import MSignCallback

    return MSignCallback(period=3, alpha=0.5)


def _drift(reference, every):
    from hf_stable.callbacks import RepresentationDriftCallback

    return lambda: RepresentationDriftCallback(
        probe_dataset=_probe_texts(), every=every, reference=reference, name=f"drift_{reference}"
    )


SFT_CELLS = {
    "plain": dict(),
    "feasible": dict(sample_reweighting="feasible", fl_epsilon=2.0),
    "auto_probe": dict(sft_objective="auto"),
    "wsm_cpu": dict(callbacks=[_wsm(storage="cpu")]),
    "wsm_disk": dict(callbacks=[_wsm(storage="disk")]),
    "wsm_merge_at_save": dict(callbacks=[_wsm(storage="cpu", merge_at=("end", "save"))]),
    "stable_rank": dict(callbacks=[_srank]),
    "msign": dict(callbacks=[_msign]),
    "drift_initial": dict(callbacks=[_drift("initial", 1)]),
    "drift_previous": dict(callbacks=[_drift("previous", 3)]),
    # transformers rebuilds the ExportableState callbacks from trainer_state.json instead
    "monitors_rebuilt": dict(
        callbacks=[_srank, _drift("previous", 3)], restore_callback_states_from_checkpoint=True
    ),
}
SFT_EXPECT = {
    "feasible": ["loss"],
    "stable_rank": ["stable/srank/"],
    "msign": ["stable/msign/"],
    "drift_initial": ["stable/drift/"],
    "drift_previous": ["stable/drift/"],
    "monitors_rebuilt": ["stable/srank/", "stable/drift/"],
}
SFT_ARTIFACTS = {
    "wsm_cpu": ["wsm-merged"],
    "wsm_disk": ["wsm-merged"],
    "wsm_merge_at_save": ["wsm-merged", f"checkpoint-{N}/wsm-merged"],
}


@pytest.mark.parametrize("cell", sorted(SFT_CELLS))
@pytest.mark.slow
def test_sft_resume_is_exact(tmp_path, cell):
    spec = dict(SFT_CELLS[cell])
    check_resume(
        tmp_path,
        _sft_builder(**spec),
        artifacts=SFT_ARTIFACTS.get(cell, ()),
        expect_metrics=SFT_EXPECT.get(cell, ()),
    )


@pytest.mark.slow
def test_sft_merge_on_train_end_resume_is_exact(tmp_path):
    from hf_stable.callbacks import MergeOnTrainEndCallback

    def merge():  # base="initial": the start weights are kept in output_dir/merge-initial across the resume
        return MergeOnTrainEndCallback(method="task_arithmetic", base="initial", params={"lambda": 0.5})

    check_resume(tmp_path, _sft_builder(callbacks=[merge]), artifacts=["merged"])


# ---------------------------------------------------------------------------------------------------------------------
# StableGRPOTrainer


def _grpo_builder(callbacks=(), rollout=True, **config):
    from grpo_helpers import GRPO_ARGS, G, deterministic_rollout, length_reward

    from hf_stable import StableGRPOConfig, StableGRPOTrainer
    from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model

    def build(output_dir):
        model, tokenizer = build_tiny_model(seed=0)
        settings = {
            **GRPO_ARGS,
            "max_steps": N,
            "learning_rate": 1e-2,
            "optim": "adamw_torch",
            "save_strategy": "steps",
            "save_steps": HALF,
            **config,
        }
        args = StableGRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=G, gradient_accumulation_steps=2, **settings
        )
        return StableGRPOTrainer(
            model=model,
            reward_funcs=[arithmetic_reward, length_reward],
            args=args,
            train_dataset=arithmetic_dataset(8, seed=0, max_operand=9),  # 4 steps per epoch
            processing_class=tokenizer,
            rollout_func=deterministic_rollout if rollout else None,
            callbacks=[factory() for factory in callbacks],
        )

    return build


GRPO_CELLS = {
    "plain": dict(),
    "sampled_generation": dict(rollout=False),  # TRL's own sampling: the torch RNG restored from the checkpoint
    "ctwa": dict(reward_weighting="ctwa", ctwa_cov_targets=[1.0, 1.0]),
    "lagrangian": dict(reward_weighting="lagrangian", lagrange_thresholds=[0.0, None], lagrange_lr=0.5),
    "gradient": dict(reward_weighting="gradient", drw_regularization=1e-2),
    "gradient_every_3": dict(reward_weighting="gradient", drw_regularization=1e-2, drw_every_n_steps=3),
    "hypervolume": dict(reward_weighting="hypervolume", drw_val_size=4),
    "snr_lr": dict(oblr_adaptive_lr=True),
    "wsm": dict(callbacks=[_wsm(storage="cpu")]),
    "stable_rank": dict(callbacks=[_srank]),
    # one generation per 2 optimizer steps, checkpoint at step 1: inside TRL's buffer of generated batches
    "buffered_generation": dict(steps_per_generation=4, save_steps=1),
    "buffered_iterations": dict(num_iterations=2, save_steps=1),  # one generation reused by 2 optimizer steps
}
GRPO_HALF = {"buffered_generation": 1, "buffered_iterations": 1}
GRPO_EXPECT = {
    "ctwa": ["stable/grpo/ctwa/"],
    "lagrangian": ["stable/grpo/lagrangian/"],
    "gradient": ["stable/grpo/drw/"],
    "gradient_every_3": ["stable/grpo/drw/"],
    "hypervolume": ["stable/grpo/hv/"],
    "snr_lr": ["stable/grpo/oblr/"],
    "stable_rank": ["stable/srank/"],
}


@pytest.mark.parametrize("cell", sorted(GRPO_CELLS))
@pytest.mark.slow
def test_grpo_resume_is_exact(tmp_path, cell):
    check_resume(
        tmp_path,
        _grpo_builder(**GRPO_CELLS[cell]),
        artifacts=["wsm-merged"] if cell == "wsm" else (),
        expect_metrics=GRPO_EXPECT.get(cell, ()),
        half=GRPO_HALF.get(cell, HALF),
    )


# ---------------------------------------------------------------------------------------------------------------------
# UnlearningTrainer


def _unlearn_builder(**config):
    from unlearn_helpers import STEP_ARGS, split_data

    from hf_stable import UnlearningConfig, UnlearningTrainer
    from hf_stable.testing import build_tiny_model

    def build(output_dir):
        model, tokenizer = build_tiny_model(seed=0)
        forget, retain = split_data()
        settings = {
            **STEP_ARGS,
            "max_steps": N,
            "learning_rate": 1e-2,
            "optim": "adamw_torch",
            "save_strategy": "steps",
            "save_steps": HALF,
            **config,
        }
        args = UnlearningConfig(output_dir=output_dir, **{"per_device_train_batch_size": 4, **settings})
        return UnlearningTrainer(
            model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tokenizer
        )

    return build


PDU = dict(unlearn_method="pdu", pdu_eps=2.0, pdu_lambda0=1.0, pdu_dual_lr=0.5)
UNLEARN_CELLS = {  # 8 forget rows, batch 4: an epoch is 2 steps, so the checkpoint falls on an epoch boundary
    "graddiff": dict(unlearn_method="graddiff"),
    "graddiff_mid_epoch": dict(unlearn_method="graddiff", per_device_train_batch_size=2),  # 4 steps per epoch
    "pdu_step": dict(PDU),
    "pdu_epoch": dict(PDU, pdu_dual_update="epoch"),
    "pdu_auto_eps": dict(PDU, pdu_eps="auto"),
    "npo": dict(unlearn_method="npo"),
    "sga_auto": dict(unlearn_method="sga", sga_num_normal=2, sga_rate="auto", sga_rate_range=[-2.0, 2.0]),
    "stableun_gauss": dict(
        unlearn_method="stableun", stableun_rho=0.05, simnpo_beta=0.5, stableun_points="sam+gauss", stableun_sigma=0.01
    ),
    "dmm_prior": dict(unlearn_method="dmm", dmm_target="prior"),
    "collapse_guard": dict(unlearn_method="graddiff", collapse_guard=True, collapse_check_steps=1),
    "collapse_restore": dict(  # retain NLL 4.46 at the start, 8.66 at step 2, 13.3 at step 3: trips at step 3
        unlearn_method="ga",
        learning_rate=0.05,
        collapse_guard=True,
        collapse_check_steps=1,
        collapse_restore_best=True,
        collapse_retain_factor=2.5,
    ),
    "collapse_restore_between_checks": dict(  # checks at steps 3 and 6 only: step 3 restores the start weights
        unlearn_method="ga",
        learning_rate=0.05,
        collapse_guard=True,
        collapse_check_steps=3,
        collapse_restore_best=True,
        collapse_retain_factor=2.5,
    ),
}
UNLEARN_EXPECT = {
    "pdu_step": ["stable/unlearning/lambda"],
    "pdu_epoch": ["stable/unlearning/lambda"],
    "collapse_guard": ["stable/unlearning/guard_retain_nll"],
    "collapse_restore": ["stable/unlearning/collapsed"],
    "collapse_restore_between_checks": ["stable/unlearning/collapsed"],
}


@pytest.mark.parametrize("cell", sorted(UNLEARN_CELLS))
@pytest.mark.slow
def test_unlearning_resume_is_exact(tmp_path, cell):
    check_resume(tmp_path, _unlearn_builder(**UNLEARN_CELLS[cell]), expect_metrics=UNLEARN_EXPECT.get(cell, ()))


# ---------------------------------------------------------------------------------------------------------------------
# the reward controllers' own round trip (what `StableGRPOTrainer._stable_state` saves), value for value


def _observed(name, **params):
    from hf_stable.losses.reward_control import REWARD_WEIGHTINGS, StepContext

    controller = REWARD_WEIGHTINGS.get(name)(torch.tensor([1.0, 0.5]), **params)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        rewards = torch.rand(8, 2, generator=generator)
        scores = torch.randn(2, generator=generator)
        if controller.needs_validation:
            controller.validation_point(rewards.mean(0) + step)
        context = StepContext(step, 1e-2, lambda scores=scores: scores)
        controller.observe(rewards, rewards.sum(1) - rewards.sum(1).mean(), 4, context)
    return controller


@pytest.mark.parametrize(
    "name, params",
    [
        ("ctwa", {}),
        ("lagrangian", {"thresholds": [0.1, None], "lr": 0.5}),
        ("gradient", {"regularization": 1e-2}),
        ("hypervolume", {}),
    ],
)
def test_controller_state_round_trip_is_exact(tmp_path, name, params):
    from safetensors.torch import save_file

    from hf_stable.losses.reward_control import REWARD_WEIGHTINGS

    trained = _observed(name, **params)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "state.safetensors"))
    fresh = REWARD_WEIGHTINGS.get(name)(torch.tensor([1.0, 0.5]), **params)
    fresh.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
    assert torch.equal(fresh.weights, trained.weights)
    assert fresh.advantage_multiplier == trained.advantage_multiplier
    if name == "hypervolume":
        assert trained.advantage_multiplier != 1.0  # the validation points moved it: the comparison is not vacuous
    for attribute, value in vars(trained).items():
        other = vars(fresh)[attribute]
        if isinstance(value, torch.Tensor):
            assert torch.equal(other, value) or torch.allclose(other, value, rtol=0, atol=0, equal_nan=True), attribute
        else:
            assert other == value or (value != value and other != other), attribute


@pytest.mark.slow
def test_stable_rank_monitor_leaves_training_unchanged(tmp_path):
    """The monitor's first power-iteration vectors come from its own generator: GRPO, whose batch shuffle draws from
    the global RNG, trains the same parameters with and without it."""
    plain = _grpo_builder(save_strategy="no")(str(tmp_path / "plain"))
    plain.train()
    monitored = _grpo_builder(callbacks=[_srank], save_strategy="no")(str(tmp_path / "monitored"))
    monitored.train()
    assert any("stable/srank/min" in h for h in monitored.state.log_history)
    start = dict(build_tiny_model_params())
    assert any(not torch.equal(p.detach(), start[n]) for n, p in plain.model.named_parameters())  # it trained
    for (name, p), q in zip(plain.model.named_parameters(), monitored.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def build_tiny_model_params():
    from hf_stable.testing import build_tiny_model

    return {n: p.detach() for n, p in build_tiny_model(seed=0)[0].named_parameters()}

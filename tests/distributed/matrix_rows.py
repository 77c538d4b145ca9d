"""The distributed matrix: every trainer option and callback, how it behaves on 2 CPU processes (gloo DDP), and what
covers it under DeepSpeed / FSDP2. Shared by `matrix_ddp_script.py` (the 2-process runs, one launch for every row)
and `test_matrix.py` (the 1-process references, the refusals, and the table in docs/distributed.md).

Each row's `run(name, out_dir, processes)` returns `{key: tensor}`; "update" is the flattened change of the trainable
parameters (SGD with lr 1, so it is minus the step's gradient) and the other keys are state that must also agree
(GRPO advantages, Feasible Learning multipliers, CTWA weights, the SFT probe's result, the `stable/*` values a
monitor logged). The global batch is the same in both layouts. A row's `rank_local` keys are estimated from each
process's own data by design: they must agree across processes, not with 1 process."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


HERE = os.path.dirname(os.path.abspath(__file__))
for folder in ("..", "../adapters", "../callbacks"):
    path = os.path.normpath(os.path.join(HERE, folder))
    if path not in sys.path:
        sys.path.insert(0, path)

from adapters_ddp_script import RUNS as ADAPTER_RUNS  # noqa: E402
from grpo_ddp_script import VARIANTS as GRPO_VARIANTS  # noqa: E402
from grpo_helpers import G, grpo_run  # noqa: E402
from sft_helpers import GLOBAL_BATCH, OBJECTIVES, one_step_update  # noqa: E402
from unlearn_helpers import METHODS as UNLEARN_METHODS  # noqa: E402
from unlearn_helpers import unlearn_update  # noqa: E402


@dataclass(frozen=True)
class Row:
    family: str
    name: str
    config: dict = field(default_factory=dict)
    ddp_refusal: str | None = None  # a message fragment: the row is refused on several processes instead
    # keys estimated from each process's own data by design (compared across ranks, not with 1 process)
    rank_local: tuple[str, ...] = ()
    # a message fragment: the row is a detector that must raise, on 1 process and on every one of 2 processes
    detects: str | None = None


SFT_THRESHOLDS = ("top_p", "bottom_p", "top_logp", "unlikelihood_top", "unlikelihood_bottom")
GRPO_EXTRA = {
    "lagrangian": {"reward_weighting": "lagrangian", "lagrange_thresholds": [None, -0.2]},
    "gradient": {"reward_weighting": "gradient"},
    "hypervolume": {"reward_weighting": "hypervolume", "drw_val_size": 4},
    "brme": {"robust_reward": "brme"},
    "stable_rank": {"stable_rank_reward": True, "stable_rank_weight": 0.1},
    "ess": {"loss_mode": "ess", "loss_type": "dapo"},
    # two optimizer steps on one generation batch: the second is off-policy, so the ESS is below 1
    "ess_stale": {"loss_mode": "ess", "loss_type": "dapo", "num_iterations": 2, "max_steps": 2},
    "ess_sequence_stale": {
        "loss_mode": "ess",
        "loss_type": "dapo",
        "ess_level": "sequence",
        "num_iterations": 2,
        "max_steps": 2,
    },
}
SFT_PROBED = {  # the objectives the base-model probe decides before the first step
    "auto": {"sft_objective": "auto", "auto_probe_batches": 1},
    "auto_model_strong": {"sft_objective": "auto", "auto_probe_batches": 1, "auto_rule": {"strong_median": 0.0}},
    "threshold_quantile": {"sft_objective": "threshold", "threshold_quantile": 0.3, "auto_probe_batches": 1},
}
# the stability fields of every hf_stable config (here StableSFTConfig), each of which attaches a callback
CONFIG_FLAGS = {
    "sft_stability_guard_flag": {
        "stability_guard": True,
        "stability_guard_kwargs": {"snapshot_every": 1, "confirm_steps": 1},
        "max_steps": 2,
    },
    "sft_no_gradient_check_off": {"no_gradient_check": False},
}
MONITORS = {  # each measures every step; MSign corrects at step 2, so step 3 starts from corrected weights
    "stable_rank_monitor": {"every": 1, "log_per_matrix": True},
    "msign": {"period": 2, "alpha": 0.5},
    "representation_drift": {"every": 1, "n_probe": 6},
}

ROWS = [
    *(Row("SFT objective", name, cfg) for name, cfg in OBJECTIVES.items()),
    *(
        Row(
            "SFT objective",
            f"threshold_{kind}",
            {"sft_objective": "threshold", "threshold_kind": kind, "threshold": 0.012},
        )
        for kind in SFT_THRESHOLDS
    ),
    Row(
        "SFT objective",
        "threshold_active_no_token_averaging",
        {"sft_objective": "threshold", "threshold": 0.012, "average_tokens_across_devices": False},
        ddp_refusal="needs average_tokens_across_devices=True",
    ),
    *(Row("GRPO", name, cfg) for name, cfg in GRPO_VARIANTS.items()),
    *(Row("SFT objective", name, cfg) for name, cfg in SFT_PROBED.items()),
    *(Row("GRPO", name, cfg) for name, cfg in GRPO_EXTRA.items()),
    Row(
        "GRPO",
        "oblr_adaptive_lr",
        {"oblr_adaptive_lr": True, "gradient_accumulation_steps": 2},
        rank_local=("lr_factor",),
    ),
    *(Row("Unlearning", name, cfg) for name, cfg in UNLEARN_METHODS.items()),
    *(Row("Adapters", name) for name in ADAPTER_RUNS),
    Row("Callback", "wsm"),
    Row("Callback", "merge_on_train_end"),
    Row("Callback", "stability_guard"),
    Row("Callback", "component_clip"),
    *(Row("Callback", name, cfg) for name, cfg in MONITORS.items()),
    *(Row("Callback", name, cfg) for name, cfg in CONFIG_FLAGS.items()),
    # last: the run raises mid-step, leaving an unfinished DDP reducer behind
    Row(
        "Callback",
        "sft_no_gradient_check_detects",
        {"no_gradient_check": True},
        detects="no trainable parameter of",
    ),
]
BY_NAME = {row.name: row for row in ROWS}
MAIN_PROCESS_ONLY = {"wsm", "merge_on_train_end"}  # rows whose result (a merged folder) only the main process has
assert len(BY_NAME) == len(ROWS), "row names must be unique"


def _adapters(name, path, processes, overrides):
    from adapter_cases import adapter_config
    from adapters_ddp_script import TWO_STEPS

    trainer_name, kind = ADAPTER_RUNS[name]
    config = {**TWO_STEPS, **overrides}
    if trainer_name == "sft":
        return one_step_update(path, GLOBAL_BATCH // processes, 1, peft_config=adapter_config(kind), **config)
    return grpo_run(path, batch_size=2 * G // processes, peft_config=adapter_config(kind), **config)


def _update_only(result):
    delta, _ = result
    return {"update": delta.contiguous()}


def _sft(row, path, processes, overrides):
    import torch

    delta, trainer = one_step_update(path, GLOBAL_BATCH // processes, 1, **row.config, **overrides)
    out = {"update": delta.contiguous()}
    if trainer._multipliers is not None:
        out["multipliers"] = trainer._multipliers.clone()
    if trainer._probe is not None:  # what the probe measured and decided, from every process's shard
        stats = trainer._probe["stats"]
        out["probe_stats"] = torch.tensor([float(stats[k]) for k in sorted(stats)], dtype=torch.float64)
        if "threshold" in trainer._probe:
            out["probe_threshold"] = torch.tensor([trainer._probe["threshold"]], dtype=torch.float64)
        objective = trainer._objective
        out["objective"] = torch.tensor([float(objective.name == "prob_power"), objective.params.get("alpha", 0.0)])
    return out


def _foreign_backbone_trainer(model=None, **kwargs):
    """StableSFTTrainer on a deep copy whose backbone forward is still the original's (the trap `no_gradient_check`
    exists for): the loss reaches only the original's weights, so none of the trained copy's parameters gets a
    gradient."""
    import copy

    from hf_stable import StableSFTTrainer

    copied = copy.deepcopy(model)
    copied.model.forward = model.model.forward
    copied.lm_head.requires_grad_(False)
    return StableSFTTrainer(model=copied, **kwargs)


def _no_gradient(row, path, processes, overrides):
    from hf_stable import StableSFTConfig

    one_step_update(
        path, GLOBAL_BATCH // processes, 1, _foreign_backbone_trainer, StableSFTConfig, **row.config, **overrides
    )
    raise AssertionError("no_gradient_check did not raise on a model whose trained parameters get no gradient")


def _grpo(row, path, processes, overrides):
    import torch

    config = dict(row.config)
    accumulation = config.pop("gradient_accumulation_steps", 1)
    delta, trainer = grpo_run(
        path, batch_size=2 * G // (processes * accumulation), grad_accum=accumulation, **config, **overrides
    )
    out = {"update": delta.contiguous(), "advantages": torch.tensor(list(trainer._logs["advantages"]))}
    if getattr(trainer, "_controller", None) is not None and hasattr(trainer._controller, "log_weights"):
        out["log_weights"] = trainer._controller.log_weights.clone()
    if trainer._snr is not None:
        # SGD with lr 1: the update is -factor * gradient; the gradient is what every layout must share
        factor = trainer._snr.factor
        out["update"] = (delta / factor).contiguous()
        out["lr_factor"] = torch.tensor([factor], dtype=torch.float64)
    return out


def _callback_trainer(path, processes, callbacks, overrides, **settings):
    """The tiny plain-`Trainer` setup of the callback tests, with SGD so updates compare exactly."""
    from wsm_helpers import make_trainer

    common = dict(per_device_train_batch_size=8 // processes, optim="sgd", weight_decay=0.0, learning_rate=0.5)
    return make_trainer(path, callbacks, **{**common, **settings, **overrides})


def _flat_state(state, names):
    import torch

    return torch.cat([state[n].detach().double().flatten() for n in names])


def _pool_folder(path):
    """A second model to merge with (same architecture, other seed), written by every process into its own folder."""
    from wsm_helpers import tiny_model

    from hf_stable.testing import build_tiny_model

    model, _ = tiny_model()
    other, _ = build_tiny_model(
        seed=1, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    assert type(other) is type(model)
    other.save_pretrained(path)
    return path


def _callback(row, path, processes, overrides):
    import torch
    from safetensors.torch import load_file

    rank = int(os.environ.get("RANK", "0"))
    if row.name == "wsm":
        from hf_stable.callbacks import WSMCallback

        cb = WSMCallback(schedule="1-sqrt", interval_steps=2, num_intervals=2, merge_at=("end",), storage="cpu")
        trainer = _callback_trainer(path, processes, [cb], overrides, max_steps=4)
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        merged = load_file(os.path.join(path, "wsm-merged", "model.safetensors")) if rank == 0 else None
    elif row.name == "merge_on_train_end":
        from hf_stable.callbacks import MergeOnTrainEndCallback

        pool = _pool_folder(f"{path}-pool-rank{rank}")
        cb = MergeOnTrainEndCallback(method="task_arithmetic", base="initial", pool=[pool], params={"lambda": 0.5})
        trainer = _callback_trainer(path, processes, [cb], overrides, max_steps=2)
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        merged = load_file(os.path.join(path, "merged", "model.safetensors")) if rank == 0 else None
    else:
        from hf_stable.callbacks import ComponentClipCallback, StabilityGuardCallback

        trainer = _callback_trainer(path, processes, [], overrides, max_steps=3, max_grad_norm=0.0)
        if row.name == "stability_guard":
            StabilityGuardCallback.attach(trainer, snapshot_every=1, confirm_steps=1)
        elif row.name == "component_clip":
            ComponentClipCallback.attach(trainer, max_norm=0.05)
        else:
            _attach_monitor(row, trainer)
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        from hf_stable import distributed

        if distributed.is_zero3_partitioned(trainer.model) or distributed.is_fsdp2(trainer.model):
            merged = distributed.gather_full_state_dict(
                trainer.model, trainer.accelerator
            )  # None off the main process
        else:
            merged = {n: p.detach() for n, p in trainer.model.named_parameters()}
    names = sorted(initial)
    if merged is None:  # only the main process writes the merged folder
        return {"update": torch.zeros(0)}
    keep = [n for n in names if n in merged]
    out = {"update": (_flat_state(merged, keep) - _flat_state(initial, keep)).float().contiguous()}
    if row.name in MONITORS:  # every `stable/*` value the monitor logged, step by step
        history = trainer.state.log_history
        logged = [float(entry[key]) for entry in history for key in sorted(entry) if key.startswith("stable/")]
        assert logged, f"{row.name} logged nothing"
        out["logged"] = torch.tensor(logged, dtype=torch.float64)
    return out


def _attach_monitor(row, trainer):
    import torch

    from hf_stable.callbacks import MSignCallback, RepresentationDriftCallback, StableRankMonitorCallback

    if row.name == "stable_rank_monitor":
        return StableRankMonitorCallback.attach(trainer, **row.config)
    if row.name == "msign":
        return MSignCallback.attach(trainer, **row.config)
    seeded = torch.Generator().manual_seed(3)
    probes = {"input_ids": torch.randint(7, trainer.model.config.vocab_size, (6, 8), generator=seeded)}
    return RepresentationDriftCallback.attach(trainer, probe_dataset=probes, name="matrix", **row.config)


def run(name, out_dir, processes, overrides=None):
    """Run one row with the global batch split over ``processes``; ``overrides``: extra training arguments (the GPU
    suite's ``use_cpu=False``)."""
    row, overrides = BY_NAME[name], overrides or {}
    path = os.path.join(out_dir, name)
    if row.family == "SFT objective":
        return _sft(row, path, processes, overrides)
    if row.family == "GRPO":
        return _grpo(row, path, processes, overrides)
    if row.family == "Unlearning":
        return _update_only(unlearn_update(path, GLOBAL_BATCH // processes, 1, **row.config, **overrides))
    if row.family == "Adapters":
        return _update_only(_adapters(name, path, processes, overrides))
    if row.detects is not None:
        return _no_gradient(row, path, processes, overrides)
    if name in CONFIG_FLAGS:
        return _sft(row, path, processes, overrides)
    return _callback(row, path, processes, overrides)

"""The distributed matrix: every trainer option and callback, how it behaves on 2 CPU processes (gloo DDP), and what
covers it under DeepSpeed / FSDP2. Shared by `matrix_ddp_script.py` (the 2-process runs, one launch for every row)
and `test_matrix.py` (the 1-process references, the refusals, and the table in docs/distributed.md).

Each row's `run(name, out_dir, processes)` returns `{key: tensor}`; "update" is the flattened change of the trainable
parameters (SGD with lr 1, so it is minus the step's gradient) and the other keys are state that must also agree
(GRPO advantages, Feasible Learning multipliers, CTWA weights). The global batch is the same in both layouts.
"""

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


SFT_THRESHOLDS = ("top_p", "bottom_p", "top_logp", "unlikelihood_top", "unlikelihood_bottom")
GRPO_EXTRA = {
    "lagrangian": {"reward_weighting": "lagrangian", "lagrange_thresholds": [None, -0.2]},
    "gradient": {"reward_weighting": "gradient"},
    "hypervolume": {"reward_weighting": "hypervolume", "drw_val_size": 4},
    "brme": {"robust_reward": "brme"},
    "stable_rank": {"stable_rank_reward": True, "stable_rank_weight": 0.1},
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
    *(Row("GRPO", name, cfg) for name, cfg in GRPO_EXTRA.items()),
    *(Row("Unlearning", name, cfg) for name, cfg in UNLEARN_METHODS.items()),
    *(Row("Adapters", name) for name in ADAPTER_RUNS),
    Row("Callback", "wsm"),
    Row("Callback", "merge_on_train_end"),
    Row("Callback", "stability_guard"),
    Row("Callback", "component_clip"),
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
    delta, trainer = one_step_update(path, GLOBAL_BATCH // processes, 1, **row.config, **overrides)
    out = {"update": delta.contiguous()}
    if trainer._multipliers is not None:
        out["multipliers"] = trainer._multipliers.clone()
    return out


def _grpo(row, path, processes, overrides):
    delta, trainer = grpo_run(path, batch_size=2 * G // processes, **row.config, **overrides)
    import torch

    out = {"update": delta.contiguous(), "advantages": torch.tensor(list(trainer._logs["advantages"]))}
    if getattr(trainer, "_controller", None) is not None and hasattr(trainer._controller, "log_weights"):
        out["log_weights"] = trainer._controller.log_weights.clone()
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
        else:
            ComponentClipCallback.attach(trainer, max_norm=0.05)
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
    return {"update": (_flat_state(merged, keep) - _flat_state(initial, keep)).float().contiguous()}


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
    return _callback(row, path, processes, overrides)

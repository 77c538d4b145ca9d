"""`MaPCallback`: evaluate the average of the last checkpoints with pass@k during training (MaP, Wang et al., arXiv
2510.09295; docs/evaluation.md, "MaP").

A [`WSMCallback`] with the `"uniform"` schedule over `num_checkpoints` snapshots taken every `interval_steps`
optimiser steps: the same window (fp32 base + a ring of deltas, RAM or disk), the same atomic save into
`checkpoint-N/map_state/` and the same resume. At every evaluation of the trainer it swaps the mean of the window
members into the model, samples `num_samples` answers per problem of `eval_dataset`, and logs the unbiased pass@k
(`hf_stable.evaluation.map_eval`) as `eval/map/pass@{k}`; the training weights are restored bit-exactly afterwards and
the sampling runs under a forked RNG, so training is the same with or without the callback.

The merge covers the members at or before the evaluation step: with `eval_steps` and `max_steps` multiples of
`interval_steps` (and no warm-up offset) the newest member is the evaluated model. Before the window holds two
members the current weights are evaluated (`eval/map/num_checkpoints` = 1). The reconstruction from the paper's
abstract is described in `hf_stable.evaluation.map_eval`.
"""

from __future__ import annotations

import inspect

from .. import distributed as dist
from ..evaluation.map_eval import check_pass_at_k_settings, evaluate_pass_at_k
from ..papers import Paper
from .wsm import WSMCallback


# kept beside the callback (not in `hf_stable.papers`) so that the paper table other modules load stays unchanged
MAP_PAPER = Paper(
    "map_eval",
    "MaP: A Unified Framework for Reliable Evaluation of Pre-training Dynamics",
    "",  # authors unchecked here (Wang et al.)
    "2510.09295",
    2025,
    "@misc{map_eval2025,\n"
    "  title         = {MaP: A Unified Framework for Reliable Evaluation of Pre-training Dynamics},\n"
    "  year          = {2025},\n  eprint        = {2510.09295},\n  archivePrefix = {arXiv}\n}",
)


# the keyword arguments of `evaluate_pass_at_k` that the callback takes (with that function's defaults, so the two
# cannot drift apart) and keeps as attributes of the same names
_PASS_AT_K_SETTINGS = ("ks", "num_samples", "scorer", "max_new_tokens", "temperature", "top_p", "seed", "batch_size")
_PASS_AT_K_DEFAULTS = {
    name: param.default for name, param in inspect.signature(evaluate_pass_at_k).parameters.items()
    if name in _PASS_AT_K_SETTINGS
}


class MaPCallback(WSMCallback):
    """Merged pass@k evaluation (MaP, arXiv 2510.09295) on top of WSM's checkpoint window.

    Args:
        eval_dataset: rows with `prompt` (text or chat messages) and `answer` columns.
        num_checkpoints: N ≥ 2, how many snapshots are averaged (WSM's `num_intervals` = N − 1).
        interval_steps: optimiser steps between snapshots; default `window_fraction × max_steps // (N − 1)`.
        window_fraction: used only without `interval_steps` (see `WSMCallback`).
        log_unmerged: also log the current weights' pass@k as `<metric_prefix>/unmerged/pass@{k}`.
        metric_prefix: prefix of the logged metrics.
        storage: where the window lives, `"cpu"`, `"disk"` or `"auto"` (see `WSMCallback`).
        trainer: the `Trainer` (set `callback.trainer = trainer` after building it); it logs the metrics and gives the
            tokenizer (`processing_class`) unless `tokenizer` is given.
        **pass_at_k: the settings of `evaluate_pass_at_k`, with its defaults:
            ks: the k of pass@k, each in [1, num_samples] (default `(1,)`).
            num_samples: n answers sampled per problem (8).
            scorer: `scorer(completion, answer) -> bool`; default exact match of the stripped strings.
            temperature, top_p: sampling settings (1.0, 1.0; `temperature=0`: greedy, needs `num_samples=1`).
            max_new_tokens, batch_size: generation settings (16, 32).
            seed: the sampling seed of every evaluation (0; the same problems get the same random stream at every
                step).
    """

    state_dir, state_json, window_dir = "map_state", "map_state.json", "map_window"

    def __init__(
        self,
        eval_dataset,
        *,
        num_checkpoints: int = 4,
        interval_steps: int | None = None,
        window_fraction: float = 0.1,
        log_unmerged: bool = False,
        metric_prefix: str = "eval/map",
        storage: str = "auto",
        trainer=None,
        tokenizer=None,
        **pass_at_k,
    ):
        unknown = sorted(set(pass_at_k) - set(_PASS_AT_K_SETTINGS))
        if unknown:
            raise TypeError(
                f"MaPCallback got unexpected arguments {unknown}; its pass@k settings are {list(_PASS_AT_K_SETTINGS)}."
            )
        settings = {**_PASS_AT_K_DEFAULTS, **pass_at_k}
        num_samples, temperature, top_p = settings["num_samples"], settings["temperature"], settings["top_p"]
        if isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int) or num_checkpoints < 2:
            raise ValueError(f"MaPCallback `num_checkpoints` must be an integer >= 2, got {num_checkpoints!r}.")
        if interval_steps is not None and (
            isinstance(interval_steps, bool) or not isinstance(interval_steps, int) or interval_steps < 1
        ):
            raise ValueError(f"MaPCallback `interval_steps` must be an integer >= 1 or None, got {interval_steps!r}.")
        if interval_steps is None and not 0.0 < window_fraction <= 1.0:
            raise ValueError(f"MaPCallback `window_fraction` must be in (0, 1], got {window_fraction!r}.")
        self.ks = check_pass_at_k_settings(settings["ks"], num_samples, temperature, "MaPCallback")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"MaPCallback `top_p` must be in (0, 1], got {top_p!r}.")
        for field in ("max_new_tokens", "batch_size"):
            value = settings[field]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MaPCallback `{field}` must be a positive integer, got {value!r}.")
        if settings["scorer"] is not None and not callable(settings["scorer"]):
            raise TypeError(
                f"MaPCallback `scorer` must be callable(completion, answer) -> bool, got {settings['scorer']!r}."
            )
        columns = getattr(eval_dataset, "column_names", None)
        if eval_dataset is None or (columns is not None and not {"prompt", "answer"} <= set(columns)):
            raise ValueError(f"MaPCallback `eval_dataset` needs 'prompt' and 'answer' columns, got {columns}.")
        super().__init__(
            schedule="uniform",
            interval_steps=interval_steps,
            window_fraction=window_fraction,
            num_intervals=num_checkpoints - 1,
            storage=storage,
            merge_at=("eval",),
            trainer=trainer,
        )
        settings.update(ks=self.ks, temperature=float(temperature), top_p=float(top_p))
        for name, value in settings.items():
            setattr(self, name, value)
        self.eval_dataset, self.num_checkpoints, self.log_unmerged = eval_dataset, num_checkpoints, log_unmerged
        self.metric_prefix, self.tokenizer = metric_prefix, tokenizer

    def _check_scheduler(self, args):
        """Any learning-rate schedule: MaP measures a run, it does not replace its decay (unlike WSM)."""

    def _score(self, model, tokenizer) -> dict[str, float]:
        settings = {name: getattr(self, name) for name in _PASS_AT_K_SETTINGS}
        return evaluate_pass_at_k(model, tokenizer, self.eval_dataset, **settings)

    def map_metrics(self, model, tokenizer) -> dict[str, float]:
        """The metrics one evaluation logs, on `model` (whose weights are restored afterwards)."""
        prefix = self.metric_prefix
        out: dict[str, float] = {}
        bare = dist.unwrap_model(model, self._accelerator())  # `generate` lives on the unwrapped model
        if len(self.steps) >= 2:
            merged, _ = self.merged_state()
            with self.swapped_in(model, merged, broadcast=True):
                scores = self._score(bare, tokenizer)
            out[f"{prefix}/num_checkpoints"] = len(self.steps)
        else:
            scores = self._score(bare, tokenizer)
            out[f"{prefix}/num_checkpoints"] = 1
        out.update({f"{prefix}/pass@{k}": scores[f"pass@{k}"] for k in self.ks})
        if self.log_unmerged:
            unmerged = scores if len(self.steps) < 2 else self._score(bare, tokenizer)
            out.update({f"{prefix}/unmerged/pass@{k}": unmerged[f"pass@{k}"] for k in self.ks})
        return out

    def on_evaluate(self, args, state, control, model=None, metrics=None, processing_class=None, **kwargs):
        if self._in_merged_eval:
            return
        model = model if model is not None else self.trainer.model
        tokenizer = self.tokenizer or processing_class or getattr(self.trainer, "processing_class", None)
        if tokenizer is None:
            raise ValueError("MaPCallback needs a `tokenizer` (or a trainer with a processing_class).")
        self._in_merged_eval = True
        try:
            out = self.map_metrics(model, tokenizer)
        finally:
            self._in_merged_eval = False
        if metrics is not None:
            metrics.update(out)
        self.trainer.log(out)


__all__ = ["MAP_PAPER", "MaPCallback"]

"""`StableSFTTrainer`'s data: per-example columns that survive TRL's data pipeline (a collator wrapper, a pair-keeping
sampler, the dataset transforms that add the columns: REDI signs and pair ids, sample indices for per-sample
multipliers) and the trainer mixin that applies them.

TRL's SFT collator only pads ``input_ids``/``labels``; per-example scalars (a sign, an index) need a signature column
(so `Trainer` does not drop them) and a collator that stacks them (`trl/trainer/sft_trainer.py:
SFTTrainer._set_signature_columns_if_needed`, `DataCollatorForLanguageModeling.torch_call`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch


logger = logging.getLogger(__name__)


SIGN_COLUMN = "redi_sign"
INDEX_COLUMN = "hf_stable_index"
PAIR_COLUMN = "hf_stable_pair_id"


def column_names(dataset) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is None:  # IterableDataset without resolved features
        names = list(next(iter(dataset)).keys())
    return list(names)


class ExtraColumnsCollator:
    """Wraps a collator: pads with it, then adds each per-example scalar column in ``columns`` as a `(B,)` tensor."""

    def __init__(self, collator, columns: Sequence[str]):
        self.collator = collator
        self.columns = tuple(columns)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        extras = {c: torch.tensor([ex[c] for ex in examples]) for c in self.columns if c in examples[0]}
        batch = self.collator([{k: v for k, v in ex.items() if k not in self.columns} for ex in examples])
        batch.update(extras)
        return batch

    def __getattr__(self, name):  # e.g. TRL reads `padding_free` off its collator
        if name == "collator" or name.startswith("__"):  # not yet set while unpickling (dataloader workers)
            raise AttributeError(name)
        return getattr(self.collator, name)


def expand_pairs(dataset):
    """``prompt``/``chosen``/``rejected`` rows → two rows each (``completion``, ``redi_sign`` ±1, pair id).

    Other columns are repeated on both rows. Pair members are adjacent, positive first.
    """
    names = column_names(dataset)
    if "prompt" not in names:
        raise ValueError(
            "sequence_objective='redi' with 'chosen'/'rejected' columns also needs a 'prompt' column (the shared "
            f"context); got columns {names}."
        )
    others = [c for c in names if c not in ("chosen", "rejected")]

    def expand(batch, indices):
        out = {c: [] for c in [*others, "completion", SIGN_COLUMN, PAIR_COLUMN]}
        for row, idx in enumerate(indices):
            for completion, sign in ((batch["chosen"][row], 1), (batch["rejected"][row], -1)):
                for c in others:
                    out[c].append(batch[c][row])
                out["completion"].append(completion)
                out[SIGN_COLUMN].append(sign)
                out[PAIR_COLUMN].append(idx)
        return out

    return dataset.map(expand, batched=True, with_indices=True, remove_columns=names)


def check_signs(dataset) -> None:
    """Every ``redi_sign`` must be +1 or -1."""
    if not hasattr(dataset, "unique"):
        return  # streamed: checked batch by batch in the loss
    bad = sorted(set(dataset.unique(SIGN_COLUMN)) - {1, -1})
    if bad:
        raise ValueError(f"Column '{SIGN_COLUMN}' must hold +1 (positive) or -1 (negative); found {bad}.")


def add_index(dataset):
    """Adds ``hf_stable_index`` = row number (the key of per-sample state such as Feasible Learning multipliers)."""
    return dataset.map(lambda _, i: {INDEX_COLUMN: i}, with_indices=True)


def complete_pairs_only(dataset):
    """Drops rows whose pair partner was removed (e.g. by TRL's filter of fully truncated completions)."""
    if PAIR_COLUMN not in column_names(dataset) or not hasattr(dataset, "select"):
        return dataset, 0
    ids = dataset[PAIR_COLUMN]
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    keep = [row for row, i in enumerate(ids) if counts[i] == 2]
    if len(keep) == len(ids):
        return dataset, 0
    return dataset.select(keep), len(ids) - len(keep)


class PairSampler(torch.utils.data.Sampler[int]):
    """Shuffles pairs (rows sharing a pair id) and yields each pair's rows consecutively.

    With an even per-device batch size both members of a pair land in the same micro-batch on the same process, as in
    the REDI reference. The order depends only on ``seed`` and the epoch (``set_epoch``), so resume replays it.
    """

    def __init__(self, pair_ids: Sequence[int], seed: int):
        groups: dict[int, list[int]] = {}
        for row, pid in enumerate(pair_ids):
            groups.setdefault(pid, []).append(row)
        self.groups = list(groups.values())
        self.seed = seed
        self.epoch = 0
        self.num_rows = len(pair_ids)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for g in torch.randperm(len(self.groups), generator=generator).tolist():
            yield from self.groups[g]

    def __len__(self) -> int:
        return self.num_rows


class SFTDataMixin:
    """Mix into `StableSFTTrainer`: adds the per-example columns the per-sample objectives need, keeps them through
    TRL's pipeline, and samples REDI pairs together."""

    def _add_columns(self, dataset, args, name: str, training: bool = True):
        names = column_names(dataset)
        if args.sequence_objective is not None:
            if {"chosen", "rejected"} <= set(names):
                dataset = expand_pairs(dataset)
                self._paired = self._paired or training
            elif SIGN_COLUMN in names:
                check_signs(dataset)
            else:
                raise ValueError(
                    f"sequence_objective={args.sequence_objective!r} needs, in the {name} dataset, either "
                    f"'prompt'/'chosen'/'rejected' columns (pairs) or a '{SIGN_COLUMN}' column (+1 positive, -1 "
                    f"negative) with 'prompt'/'completion'; got columns {names}."
                )
        if args.sample_reweighting is not None and training:
            if not hasattr(dataset, "__len__"):
                raise ValueError(
                    f"sample_reweighting={args.sample_reweighting!r} keeps one multiplier per training sample and "
                    "needs a sized `datasets.Dataset`, not an IterableDataset."
                )
            self._num_samples = len(dataset)
            dataset = add_index(dataset)
        return dataset

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        dataset, dropped = complete_pairs_only(dataset)
        if dropped:
            logger.warning(f"Dropped {dropped} {dataset_name} rows whose REDI pair partner was removed by truncation.")
        return dataset

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for column in (SIGN_COLUMN, INDEX_COLUMN):
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset
        if (
            self.args.sequence_objective is not None
            and hasattr(dataset, "column_names")
            and PAIR_COLUMN in dataset.column_names
        ):
            if self.args.per_device_train_batch_size % 2:
                warnings.warn(
                    "REDI pairs are kept together only with an even per_device_train_batch_size; with "
                    f"{self.args.per_device_train_batch_size} a pair can straddle two micro-batches.",
                    stacklevel=2,
                )
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return PairSampler(dataset[PAIR_COLUMN], seed)
        return super()._get_train_sampler(train_dataset)

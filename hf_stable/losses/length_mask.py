"""Length-conditional reward masking (Ye et al., BalCapRL, arXiv 2605.07394): chosen reward columns are withheld from
completions whose length, relative to a reference length, falls outside a band.

The paper gates a reward (its linguistic-quality reward for captions) on the ratio of the generated length to the
reference caption's length, as a length penalty that acts only past a threshold instead of a linear one that keeps
pushing towards shorter outputs. Its code is not public and the abstract gives no threshold, so the rule below is
reconstructed: with `ρ_i = L_i / L_ref,i`, a masked column's reward becomes ``fill`` where `ρ_i < min_ratio` or
`ρ_i > max_ratio`, and is kept otherwise. The defaults (`max_ratio = 1`: no longer than the reference; no lower
bound; fill 0) are ours. It runs on the rewards of the whole generation batch before any normalisation, so it
composes with either `multi_objective_aggregation` and with every estimator, loss mode and controller.
"""

from __future__ import annotations

import math

import torch

from .._validation import check_int, number
from ..papers import PAPERS
from ..registry import Field, Registry, Requires


def _check_columns(name: str, value, where: str | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"`{name}` must be a non-empty list of reward columns or None, got {value!r}.")
    for column in value:
        check_int(name, column, low=0, where=where)
    if len(set(value)) != len(value):
        raise ValueError(f"`{name}` lists a reward column twice: {value!r}.")


def _check_reference(name: str, value, where: str | None = None) -> None:
    if value is None or (isinstance(value, str) and value):
        return
    number(low=0, low_open=True)(name, value, where)


LENGTH_MASKS = Registry(
    "length_mask",
    "length-conditional masks of reward columns",
    selector="length_mask_rewards",
    enable=[0],
    selector_check=_check_columns,
)


def length_conditional_mask(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    reference: torch.Tensor,
    columns: list[int],
    min_ratio: float | None = None,
    max_ratio: float | None = 1.0,
    fill: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Withhold the rewards in ``columns`` from completions whose length ratio leaves `[min_ratio, max_ratio]`.

    Args:
        rewards (`torch.Tensor` of shape `(N, K)`): one column per reward function (NaN: did not apply).
        lengths (`torch.Tensor` of shape `(N,)`): completion lengths in tokens.
        reference (`torch.Tensor` of shape `(N,)`): each completion's reference length in tokens (> 0).
        columns (`list[int]`): the reward columns masked.
        min_ratio, max_ratio (`float`, *optional*): the band of `L / L_ref` inside which rewards are kept (`None`:
            unbounded on that side).
        fill (`float`): the value a masked reward takes; a NaN reward (did not apply) stays NaN.

    Returns:
        `(rewards (N, K), {"masked_frac"})`: a new tensor, and the fraction of completions outside the band.
    """
    if rewards.dim() != 2 or lengths.shape != rewards.shape[:1] or reference.shape != rewards.shape[:1]:
        raise ValueError(
            f"rewards must be (N, K) with lengths and reference (N,), got {tuple(rewards.shape)}, "
            f"{tuple(lengths.shape)}, {tuple(reference.shape)}."
        )
    if any(not 0 <= c < rewards.shape[1] for c in columns):
        raise ValueError(f"`length_mask_rewards`={columns} must name columns of the {rewards.shape[1]} rewards.")
    reference = reference.double()
    if not (torch.isfinite(reference) & (reference > 0)).all():
        raise ValueError("`length_mask_reference` lengths must be finite and > 0.")
    ratio = lengths.double() / reference
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if min_ratio is not None:
        outside |= ratio < min_ratio
    if max_ratio is not None:
        outside |= ratio > max_ratio
    out = rewards.clone()
    block = out[:, columns]
    masked = outside.unsqueeze(1) & ~torch.isnan(block)
    out[:, columns] = torch.where(masked, torch.full_like(block, fill), block)
    return out, {"masked_frac": outside.float().mean().item() if len(outside) else 0.0}


def _band_is_empty(args) -> bool:
    low, high = args.length_mask_min_ratio, args.length_mask_max_ratio
    return low is not None and high is not None and low > high


@LENGTH_MASKS.register(
    "length_conditional",
    paper=PAPERS["balcaprl"],
    description="withhold chosen rewards from completions whose length ratio to a reference leaves a band",
    fields=[
        Field(
            "length_mask_reference",
            None,
            "Reference length of each prompt: a dataset column (its values a number of tokens, or a reference text "
            "whose tokens are counted), or one number of tokens for every prompt. Required by the mask.",
            check=_check_reference,
            type=float | str | None,  # parsed as a string from the command line (a number is converted)
        ),
        Field(
            "length_mask_min_ratio",
            None,
            "Rewards are withheld below this ratio of completion to reference length (`None`: no lower bound).",
            check=number(low=0, allow_none=True),
            param="min_ratio",
            type=float | None,
        ),
        Field(
            "length_mask_max_ratio",
            1.0,
            "Rewards are withheld above this ratio of completion to reference length (`None`: no upper bound).",
            check=number(low=0, low_open=True, allow_none=True),
            param="max_ratio",
            type=float | None,
        ),
        Field("length_mask_fill", 0.0, "The value a withheld reward takes.", check=number(), param="fill"),
    ],
    reads={"columns": "length_mask_rewards"},
    requires=[
        Requires(
            "length_mask_reference",
            lambda value: value is not None,
            "the mask needs a reference length: a dataset column or a number of tokens",
            fix=4,
        ),
        Requires(
            "length_mask_max_ratio",
            lambda value: False,
            "the band is empty: length_mask_max_ratio must be at least length_mask_min_ratio",
            when=_band_is_empty,
        ),
        Requires(
            "length_mask_max_ratio",
            lambda value: value is not None,
            "with neither bound the mask withholds nothing: set length_mask_min_ratio or length_mask_max_ratio",
            when=lambda args: args.length_mask_min_ratio is None,
        ),
    ],
)
def length_mask(rewards, lengths, reference, columns, min_ratio=None, max_ratio=1.0, fill=0.0):
    """The registered method: [`length_conditional_mask`]."""
    return length_conditional_mask(rewards, lengths, reference, columns, min_ratio, max_ratio, fill)


def check_length_mask(args, num_rewards: int, *datasets) -> None:
    """Refuse by name, when the trainer is built, a masked column that is not a reward function's or a reference
    column that a training or evaluation dataset lacks (``datasets``: datasets, dicts of them or `None`; one without
    `column_names`, e.g. an iterable dataset, is checked when its rows arrive)."""
    columns, reference = args.length_mask_rewards, args.length_mask_reference
    if any(c >= num_rewards for c in columns):
        raise ValueError(f"`length_mask_rewards`={columns} must name columns of the {num_rewards} reward functions.")
    if not isinstance(reference, str):
        return
    for dataset in datasets:
        for part in dataset.values() if isinstance(dataset, dict) else [dataset]:
            names = getattr(part, "column_names", None)
            if names is not None and reference not in names:
                raise ValueError(f"`length_mask_reference`={reference!r} is not a column of the data: {names}.")


def reference_lengths(inputs: list[dict], reference, tokenizer) -> list[float]:
    """Each completion's reference length from its dataset row: ``reference`` a column name (numbers are token
    counts; a text is measured in ``tokenizer``'s tokens, without special tokens) or one number for all. Raises
    ``ValueError`` naming `length_mask_reference` for a missing column or an unusable value."""
    if not isinstance(reference, str):
        return [float(reference)] * len(inputs)
    out = []
    for row in inputs:
        if reference not in row:
            raise ValueError(
                f"`length_mask_reference`={reference!r} is not a column of the dataset (columns: {sorted(row)})."
            )
        value = row[reference]
        length = len(tokenizer(value, add_special_tokens=False).input_ids) if isinstance(value, str) else value
        usable = isinstance(length, (int, float)) and not isinstance(length, bool) and math.isfinite(length)
        if not usable or length <= 0:
            raise ValueError(f"`length_mask_reference` column {reference!r} holds {value!r}: need a length > 0.")
        out.append(float(length))
    return out

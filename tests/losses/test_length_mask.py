"""Length-conditional reward masking (BalCapRL, arXiv 2605.07394; the rule as reconstructed in
`hf_stable/losses/length_mask.py`): values by hand, the reference lengths, and the config's refusals by name."""

from __future__ import annotations

import math

import pytest
import torch

from hf_stable import StableGRPOConfig
from hf_stable.losses.length_mask import LENGTH_MASKS, length_conditional_mask, reference_lengths
from hf_stable.papers import PAPERS
from hf_stable.testing import build_tiny_tokenizer


def test_mask_by_hand():
    rewards = torch.tensor([[1.0, 0.9], [0.0, 0.8], [1.0, math.nan], [1.0, 0.5], [0.5, 0.7]])
    lengths = torch.tensor([10, 25, 40, 19, 5])
    reference = torch.tensor([20.0, 20.0, 20.0, 20.0, 20.0])  # ratios 0.5, 1.25, 2.0, 0.95, 0.25
    out, metrics = length_conditional_mask(rewards, lengths, reference, [1], min_ratio=0.4, max_ratio=1.0, fill=-1.0)
    want = torch.tensor([[1.0, 0.9], [0.0, -1.0], [1.0, math.nan], [1.0, 0.5], [0.5, -1.0]])
    torch.testing.assert_close(out, want, equal_nan=True)  # the NaN (did not apply) stays NaN
    assert metrics == {"masked_frac": pytest.approx(3 / 5)}
    assert torch.equal(rewards[1], torch.tensor([0.0, 0.8]))  # the input is not modified
    # the defaults: no lower bound, at most the reference's length, fill 0; several columns at once
    out, _ = length_conditional_mask(rewards, lengths, reference, [0, 1])
    assert out[1].tolist() == [0.0, 0.0] and torch.equal(out[3:], rewards[3:])
    assert out[2, 0] == 0 and math.isnan(out[2, 1])


def test_ratio_exactly_on_a_bound_is_kept():
    rewards = torch.ones(2, 1)
    out, metrics = length_conditional_mask(rewards, torch.tensor([3, 6]), torch.tensor([3.0, 3.0]), [0], 1.0, 2.0)
    assert torch.equal(out, rewards) and metrics["masked_frac"] == 0


def test_mask_rejects_bad_inputs():
    rewards = torch.ones(2, 2)
    with pytest.raises(ValueError, match="length_mask_rewards"):
        length_conditional_mask(rewards, torch.ones(2), torch.ones(2), [2])
    with pytest.raises(ValueError, match="length_mask_reference"):
        length_conditional_mask(rewards, torch.ones(2), torch.tensor([1.0, 0.0]), [0])
    with pytest.raises(ValueError, match=r"must be \(N, K\)"):
        length_conditional_mask(rewards, torch.ones(3), torch.ones(2), [0])


def test_reference_lengths_from_numbers_texts_or_one_value():
    tokenizer = build_tiny_tokenizer()
    text = "12+34="
    rows = [{"ref": 7}, {"ref": 2.5}, {"ref": text}]
    want_text = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert want_text > 0
    assert reference_lengths(rows, "ref", tokenizer) == [7.0, 2.5, float(want_text)]
    assert reference_lengths(rows, 12, tokenizer) == [12.0] * 3
    with pytest.raises(ValueError, match=r"length_mask_reference.*not a column"):
        reference_lengths([{"other": 1}], "ref", tokenizer)
    with pytest.raises(ValueError, match="length_mask_reference"):
        reference_lengths([{"ref": 0}], "ref", tokenizer)
    with pytest.raises(ValueError, match="length_mask_reference"):
        reference_lengths([{"ref": None}], "ref", tokenizer)


_CPU = {"use_cpu": True, "report_to": "none"}


def test_declared_once_with_its_paper():
    method = LENGTH_MASKS.get("length_conditional")
    assert method.paper is PAPERS["balcaprl"] and method.paper.arxiv == "2605.07394"
    assert [f.name for f in method.fields] == [
        "length_mask_reference",
        "length_mask_min_ratio",
        "length_mask_max_ratio",
        "length_mask_fill",
    ]
    args = StableGRPOConfig("out", length_mask_rewards=[1], length_mask_reference="ref", **_CPU)
    assert LENGTH_MASKS.active(args) is method
    assert method.params_from(args) == {"columns": [1], "min_ratio": None, "max_ratio": 1.0, "fill": 0.0}
    assert LENGTH_MASKS.active(StableGRPOConfig("out", **_CPU)) is None
    # a number of tokens given on the command line arrives as a string
    args = StableGRPOConfig("out", length_mask_rewards=[0], length_mask_reference="12", **_CPU)
    assert args.length_mask_reference == 12


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"length_mask_rewards": [0]}, "length_mask_reference=None"),
        ({"length_mask_rewards": []}, "length_mask_rewards"),
        ({"length_mask_rewards": [0, 0], "length_mask_reference": 3}, "length_mask_rewards"),
        ({"length_mask_rewards": [-1], "length_mask_reference": 3}, "length_mask_rewards"),
        ({"length_mask_rewards": [0], "length_mask_reference": 0}, "length_mask_reference"),
        ({"length_mask_rewards": [0], "length_mask_reference": 3, "length_mask_max_ratio": 0.0}, "_max_ratio"),
        ({"length_mask_rewards": [0], "length_mask_reference": 3, "length_mask_min_ratio": 2.0}, "the band is empty"),
        ({"length_mask_rewards": [0], "length_mask_reference": 3, "length_mask_max_ratio": None}, "withholds nothing"),
        ({"length_mask_rewards": [0], "length_mask_reference": 3, "length_mask_fill": math.nan}, "length_mask_fill"),
    ],
)
def test_config_refuses_by_name(config, named):
    with pytest.raises(ValueError) as error:
        StableGRPOConfig("out", **_CPU, **config)
    assert named in str(error.value), str(error.value)


def test_command_line_parses_a_column_or_a_number_of_tokens():
    from transformers import HfArgumentParser

    parser = HfArgumentParser(StableGRPOConfig)
    base = ["--output_dir", "out", "--use_cpu", "--report_to", "none", "--length_mask_rewards", "0", "2"]
    (args,) = parser.parse_args_into_dataclasses([*base, "--length_mask_reference", "12"])
    assert args.length_mask_rewards == [0, 2] and args.length_mask_reference == 12.0
    (args,) = parser.parse_args_into_dataclasses([*base, "--length_mask_reference", "reference_caption"])
    assert args.length_mask_reference == "reference_caption"

"""DARE/DELLA draw each keep mask once: the L1-rescale pass keeps the masks it drew for the combine of the same
pieces, and the output is bitwise the one of drawing every mask again (a cache of size 0), at any budget."""

from __future__ import annotations

import pytest
import torch
from merge_helpers import load_folder_state_dict

from hf_stable.merging import MergeConfig, merge, rng
from hf_stable.merging.methods import dare


@pytest.mark.parametrize(("method", "budget"), [("della", None), ("della", 20_000), ("dare_ties", None)])
def test_masks_drawn_once_and_output_unchanged(pico_models, tmp_path, monkeypatch, method, budget):
    cfg = MergeConfig.build(method, pico_models["experts"][:2], base_model=pico_models["base"],
                            parameters={"density": 0.5}, seed=3)  # fmt: skip
    calls = {"della": 0, "dare_ties": 0}
    thresholds, keep_mask = dare.della_thresholds, rng.keep_mask

    def counted_thresholds(*a, **k):
        calls["della"] += 1
        return thresholds(*a, **k)

    def counted_keep(*a, **k):
        calls["dare_ties"] += 1
        return keep_mask(*a, **k)

    monkeypatch.setattr(dare, "della_thresholds", counted_thresholds)
    monkeypatch.setattr(rng, "keep_mask", counted_keep)
    merge(cfg, tmp_path / "cached", memory_budget=budget, progress=False)
    once = calls[method]
    monkeypatch.setattr(dare, "MASK_CACHE_BYTES", 0, raising=False)
    calls[method] = 0
    merge(cfg, tmp_path / "redrawn", memory_budget=budget, progress=False)
    assert once > 0 and calls[method] == 2 * once  # sums pass + combine without the cache, sums pass only with it
    got, want = load_folder_state_dict(tmp_path / "cached"), load_folder_state_dict(tmp_path / "redrawn")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name

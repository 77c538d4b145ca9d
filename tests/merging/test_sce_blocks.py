"""SCE's blockwise arithmetic gives the bits of the whole-tensor formula (mergekit 0.1.5 `sce_merge` as written:
`torch.var` over the models, a sorted `torch.topk`, whole-tensor temporaries), on inputs whose blocks split the
tensor unevenly and whose rows are not contiguous (the engine's buffers)."""

from __future__ import annotations

import pytest
import torch

from hf_stable.merging.methods.sce import population_variance, sce_combine


def _whole_tensor_sce(tv: torch.Tensor, select_topk: float) -> torch.Tensor:
    if select_topk < 1:
        keep = torch.zeros_like(tv[0])
        spread = torch.var(tv, dim=0, unbiased=False)
        k = int(int(torch.count_nonzero(spread)) * select_topk)
        if k > 0:
            keep[torch.topk(spread.abs(), k=k, largest=True).indices] = 1
        tv = tv * keep
    majority = (tv.sum(dim=0) >= 0).to(tv.dtype) * 2 - 1
    erased = (tv.square().mean(dim=1) / tv.square().mean(dim=1).sum()).unsqueeze(-1) * (tv.sign() == majority)
    return (tv * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)


def _inputs(n_models: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n_models, n + 37, generator=g) * 0.01
    wide[:, :50] = 0.0  # zero variance: never selected
    wide[1, 50:90] = wide[0, 50:90]  # repeated values across models
    wide[:, 90:130] = wide[:, 130:170]  # tied variances at other positions
    return wide.to(dtype)[:, :n]  # rows with a stride longer than n, as the engine's buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_models", [2, 3, 5])
def test_population_variance_is_torch_var_bitwise(dtype, n_models):
    tv = _inputs(n_models, 70_001, dtype, seed=n_models)
    for scale in (1e-4, 1.0, 300.0):
        x = (tv.float() * scale).to(dtype)
        want = torch.var(x, dim=0, unbiased=False)
        got = population_variance(x, block=4099)
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_models", "select_topk"), [(2, 0.5), (3, 0.1), (4, 1.0), (2, 0.01)])
def test_sce_combine_equals_whole_tensor_formula_bitwise(dtype, n_models, select_topk, monkeypatch):
    monkeypatch.setattr("hf_stable.merging.methods.sce._BLOCK", 10_007)  # several uneven blocks
    tv = _inputs(n_models, 50_000, dtype, seed=7 * n_models)
    want = _whole_tensor_sce(tv, select_topk)
    got = sce_combine(tv, select_topk)
    assert got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got, tv[0])  # the merge did something


@pytest.mark.parametrize(("models", "dtype"), [("pico_models", None), ("pico_bf16_models", "bfloat16")])
def test_engine_sce_streams_rows_and_equals_whole_tensor_formula(request, tmp_path, monkeypatch, models, dtype):
    """The engine feeds SCE its task vectors row by row from the stored inputs: no `(N, n)` float32 copy of a
    tensor (`Execution._load` is never called; the float32 block of a 32000 × 1024 embedding of three models alone
    was 393 MiB), and every output tensor is the whole-tensor formula on `x_i − base`, plus base, bit for bit."""
    from merge_helpers import load_folder_state_dict

    from hf_stable.merging import MergeConfig, merge
    from hf_stable.merging.execution import Execution

    paths = request.getfixturevalue(models)
    experts = paths["experts"][:2]
    kw = {"dtype": dtype} if dtype else {}
    cfg = MergeConfig.build("sce", experts, base_model=paths["base"], parameters={"select_topk": 0.5}, **kw)

    def no_block(*a, **k):
        raise AssertionError("SCE built an (N, n) float32 block")

    monkeypatch.setattr(Execution, "_load", no_block)
    merge(cfg, tmp_path / "out", progress=False)
    got = load_folder_state_dict(tmp_path / "out")
    base = load_folder_state_dict(paths["base"])
    xs = [load_folder_state_dict(p) for p in experts]
    cdt = getattr(torch, dtype) if dtype else torch.float32
    checked = 0
    for name, b in base.items():
        if not b.is_floating_point():
            continue
        tv = torch.stack([(x[name].float() - b.float()).to(cdt).reshape(-1) for x in xs])
        want = (_whole_tensor_sce(tv, 0.5).float() + b.float().reshape(-1)).to(cdt).to(got[name].dtype)
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.view(torch.uint8)), name
        checked += 1
    assert checked > 5

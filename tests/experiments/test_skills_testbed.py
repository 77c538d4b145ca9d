"""The merging testbed's losing-merge control (`experiments/testbeds/skills.py`): the permuted twin must be the same
function in another basis, or averaging with it would lose for a reason other than misaligned weights."""

import sys
from pathlib import Path

import torch


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
from testbeds import skills  # noqa: E402

from hf_stable.testing import build_tiny_model  # noqa: E402


def test_permuted_twin_computes_the_same_function_with_other_weights():
    model, _ = build_tiny_model(seed=0)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    twin = skills.permuted_twin(params, seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        model.load_state_dict(twin)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    moved = [k for k in params if params[k].dim() == 2 and not torch.equal(params[k], twin[k])]
    assert len(moved) == sum(p.dim() == 2 for p in params.values())  # every matrix is in another basis
    average = {k: (params[k] + twin[k]) / 2 for k in params}
    model.load_state_dict(average)
    with torch.no_grad():
        assert (model(ids).logits - before).abs().max() > 1e-2  # and the average is another function

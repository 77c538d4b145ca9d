"""The relearning attack fine-tunes a copy: also of a model that TRL's SFTTrainer patched (fused LM head)."""

import torch
from unlearn_helpers import split_data

from hf_stable.evaluation.unlearning import relearn_attack
from hf_stable.testing import build_tiny_model


def test_relearn_attack_on_a_trl_patched_model_trains_its_copy_not_the_model():
    from trl.trainer.utils import add_fused_lm_head

    forget, retain = split_data()
    reports = []
    for patched in (False, True):
        model, tok = build_tiny_model(seed=0)
        if patched:
            add_fused_lm_head(model)  # what `trl.SFTTrainer` leaves behind: a forward closing over `model`
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        reports.append(relearn_attack(model, tok, forget, retain, steps=3, lr=1e-2, batch_size=8))
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]) and p.grad is None, n  # the model itself is untouched
    # the copy learned exactly what an unpatched copy learns (before the fix it trained the original's weights)
    assert reports[1] == reports[0]

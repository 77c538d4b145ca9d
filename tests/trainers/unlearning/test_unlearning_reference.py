"""The starting model as a reference: NPO's S_ref computed after the model is prepared and checkpointed, and
reference copies that do not follow the trained model (the deepcopy trap of TRL's patched forward)."""

import copy
import os

import pytest
import torch
from sft_helpers import assert_same_update
from unlearn_helpers import GLOBAL_BATCH, STEP_ARGS, split_data, unlearn_update

from hf_stable import UnlearningConfig, UnlearningTrainer
from hf_stable.testing import build_tiny_model
from hf_stable.trainers.unlearning.data import tokenize_row
from hf_stable.trainers.unlearning.reference import own_forward


def _summed_answer_logps(model, tokenizer, rows) -> torch.Tensor:
    """`S` per row in float64 from plain per-row forwards (no padding, no batching)."""
    out = []
    for row in rows:
        ex = tokenize_row(tokenizer, row["prompt"], row["completion"])
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1].double(), -1)
        targets = torch.tensor(ex["labels"][1:])
        keep = targets != -100
        out.append(logprobs[keep].gather(-1, targets[keep, None]).sum())
    return torch.stack(out)


def test_npo_reference_logps_come_from_the_starting_model_at_the_first_step(tmp_path):
    """Nothing runs a forward at construction (under DeepSpeed the model is not placed yet); the first step caches the
    starting model's S_ref, which stays fixed while the weights move."""
    _, trainer = unlearn_update(tmp_path, GLOBAL_BATCH, 1, unlearn_method="npo", train=False)
    assert trainer._ref_seq_logps is None
    trainer.args.max_steps = 3
    trainer.train()
    start, tok = build_tiny_model(seed=0)
    expected = _summed_answer_logps(start, tok, split_data()[0])
    assert torch.allclose(trainer._ref_seq_logps.double(), expected, atol=1e-4)
    moved = _summed_answer_logps(trainer.model, tok, split_data()[0])
    assert not torch.allclose(moved, expected, atol=1e-2)  # the weights moved, the reference did not


def test_npo_resume_keeps_the_reference_of_the_start(tmp_path):
    """S_ref is saved in the checkpoint: a run resumed at step 2 (whose weights have moved) ends where an
    uninterrupted run ends."""
    config = dict(
        unlearn_method="npo",
        learning_rate=1e-2,
        optim="adamw_torch",
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )
    full, _ = unlearn_update(tmp_path / "full", 4, 1, **config)
    assert os.path.isfile(tmp_path / "full" / "checkpoint-2" / "hf_stable_state.safetensors")
    model, tok = build_tiny_model(seed=0)
    forget, retain = split_data()
    args = UnlearningConfig(
        output_dir=str(tmp_path / "full"), per_device_train_batch_size=4, **{**STEP_ARGS, **config}
    )
    resumed = UnlearningTrainer(
        model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok
    )
    start = build_tiny_model(seed=0)[0].state_dict()
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "full", "checkpoint-2"))
    delta = torch.cat([(p.detach() - start[n]).flatten() for n, p in resumed.model.named_parameters()])
    assert_same_update(delta, full)


def test_precompute_ref_logps_is_only_a_cache(tmp_path):
    """With the starting model as `ref_model`, caching S_ref or running the reference live gives the same update."""
    cached, _ = unlearn_update(tmp_path / "a", GLOBAL_BATCH, 1, unlearn_method="npo", npo_beta=0.5)
    reference = build_tiny_model(seed=0)[0]
    live, _ = unlearn_update(
        tmp_path / "b",
        GLOBAL_BATCH,
        1,
        unlearn_method="npo",
        npo_beta=0.5,
        precompute_ref_logps=False,
        trainer_kwargs={"ref_model": reference},
    )
    assert_same_update(live, cached)


def _patched_by_trl(model):
    """What `trl.SFTTrainer` leaves on a model it trained: an instance-level forward closing over the model."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)
    assert "forward" in model.__dict__
    return model


def test_own_forward_drops_only_patches_that_call_another_module():
    model = _patched_by_trl(build_tiny_model(seed=0)[0])
    assert own_forward(model).__dict__.get("forward") is not None  # calls itself: kept
    clone = copy.deepcopy(model)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
        assert torch.equal(
            clone(input_ids=ids).logits, model(input_ids=ids).logits
        )  # the trap: the original's weights
        own_forward(clone)
        assert "forward" not in clone.__dict__
        assert not torch.allclose(clone(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("given", [False, True], ids=["copied_by_the_trainer", "ref_model_deepcopy"])
def test_kl_reference_of_a_trl_patched_model_stays_the_starting_model(tmp_path, given):
    """The KL retain term's reference must not follow the trained weights (a copy made by the trainer, or a
    `copy.deepcopy` the user passes as `ref_model`)."""
    model, tok = build_tiny_model(seed=0)
    model = _patched_by_trl(model)
    forget, retain = split_data()
    args = UnlearningConfig(
        output_dir=str(tmp_path), retain_loss_type="kl", per_device_train_batch_size=8, **STEP_ARGS
    )
    kwargs = {"ref_model": copy.deepcopy(model)} if given else {}
    trainer = UnlearningTrainer(
        model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok, **kwargs
    )
    trainer.train()
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        start = build_tiny_model(seed=0)[0](input_ids=ids).logits
        assert not torch.allclose(trainer.model(input_ids=ids).logits, start, atol=1e-3)  # the model was trained
        assert torch.allclose(trainer._ref_model(input_ids=ids).logits, start, atol=1e-6)


def test_relearning_probe_of_a_trl_patched_model_trains_its_copy(tmp_path):
    """The probe fine-tunes a copy: with TRL's patched forward the copy's forward would run the trained model's
    weights, so the probe would learn nothing (and leave gradients on the real model)."""
    reports = []
    for patched in (False, True):
        model, tok = build_tiny_model(seed=0)
        model = _patched_by_trl(model) if patched else model
        forget, retain = split_data()
        config = {**STEP_ARGS, "relearn_probe_steps": 3, "relearn_probe_lr": 1e-2}
        args = UnlearningConfig(output_dir=str(tmp_path / str(patched)), per_device_train_batch_size=8, **config)
        trainer = UnlearningTrainer(
            model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok
        )
        trainer.train()
        assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
        reports.append(trainer.relearn_report)
    assert reports[1] == pytest.approx(reports[0], rel=1e-5)


def test_kl_reference_of_an_already_adapted_peft_model_is_the_adapted_model(tmp_path):
    """A PeftModel whose adapters already act (e.g. after LoRA SFT) starts *with* them: the KL reference must be
    that model (zero KL at the start), not the adapter-free base. Fresh adapters keep the disabled-adapter path."""
    from peft import LoraConfig, get_peft_model

    model, tok = build_tiny_model(seed=0)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    forget, retain = split_data()
    args = UnlearningConfig(
        output_dir=str(tmp_path), retain_loss_type="kl", per_device_train_batch_size=8, **STEP_ARGS
    )
    trainer = UnlearningTrainer(
        model=adapted, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok
    )
    assert trainer._ref_model is not None
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(GLOBAL_BATCH)]))
    trainer._step_counts = None
    assert abs(trainer._retain_term(trainer.model, batch).item()) < 1e-7

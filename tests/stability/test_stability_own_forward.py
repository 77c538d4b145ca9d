"""`StableSFTTrainer` hands back a model with its own forward (TRL's fused LM-head patch is attached only while the
trainer runs), so a deep copy of a trained model trains itself; for a copy of a plain `SFTTrainer` model the
no-gradient diagnosis names the patched forward (our trainers repair such a copy at construction). One detection of
foreign forwards serves the check, the repair and the unlearning reference copies."""

import copy

import torch
from sft_helpers import STEP_ARGS, dataset_for
from transformers import TrainerCallback
from unlearn_helpers import split_data

from hf_stable.stability import nograd
from hf_stable.testing import build_tiny_model


class _ForwardProbe(TrainerCallback):
    """Records whether the model's forward was patched on the instance while training and evaluating."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append("forward" in model.__dict__)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.seen.append("forward" in model.__dict__)


def _sft(tmp_path, trainer_cls, config_cls, steps=2, **config):
    model, tokenizer = build_tiny_model(seed=0)
    data = dataset_for({})
    args = config_cls(str(tmp_path), **{**STEP_ARGS, "max_steps": steps, "learning_rate": 1e-2, **config})
    return trainer_cls(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)


def _unlearn(tmp_path, model):
    from hf_stable import UnlearningConfig, UnlearningTrainer

    forget, retain = split_data()
    args = UnlearningConfig(
        str(tmp_path), max_steps=1, per_device_train_batch_size=8, learning_rate=1e-2, optim="sgd",
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, collapse_guard=False,
    )  # fmt: skip
    tokenizer = build_tiny_model(seed=0)[1]
    return UnlearningTrainer(model=model, args=args, forget_dataset=forget, retain_dataset=retain,
                             processing_class=tokenizer)  # fmt: skip


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_stable_sft_hands_back_its_own_forward_and_a_deepcopy_trains(tmp_path):
    from hf_stable import StableSFTConfig, StableSFTTrainer

    trainer = _sft(tmp_path / "sft", StableSFTTrainer, StableSFTConfig, eval_strategy="steps", eval_steps=1)
    probe = _ForwardProbe()
    trainer.add_callback(probe)
    trainer.train()
    assert probe.seen == [True] * 4  # the fused head is there for every step and the evaluations inside train
    assert "forward" not in trainer.model.__dict__  # ... and gone afterwards
    loss = trainer.evaluate()["eval_loss"]  # evaluating again attaches it again
    assert loss > 0 and "forward" not in trainer.model.__dict__
    assert not nograd.foreign_forwards(trainer.model)

    copied = copy.deepcopy(trainer.model)
    before = _params(copied)
    original = _params(trainer.model)
    _unlearn(tmp_path / "unlearn", copied).train()
    assert any(not torch.equal(p, before[n]) for n, p in copied.named_parameters())
    assert all(torch.equal(p, original[n]) for n, p in trainer.model.named_parameters())  # the original is untouched


def test_deepcopy_of_a_trl_sft_model_is_diagnosed_naming_the_fused_forward(tmp_path):
    """The detection and the message; a plain trainer raising it, and our trainers repairing the copy at
    construction, are tests/conformance/test_defects.py."""
    from trl import SFTConfig, SFTTrainer

    trainer = _sft(tmp_path / "sft", SFTTrainer, SFTConfig)
    trainer.train()
    copied = copy.deepcopy(trainer.model)
    (hit,) = nograd.foreign_forwards(copied)
    assert hit[0] == "" and hit[1] == "_fused_forward (trl/trainer/utils.py)" and hit[2] is trainer.model
    message = nograd.diagnose_no_gradient(copied)
    assert "`_fused_forward (trl/trainer/utils.py)`" in message and "deepcopy" in message
    before = _params(copied)

    # the fix the message names: `own_forward` (the same detection), then the copy trains
    nograd.own_forward(copied)
    assert "forward" not in copied.__dict__
    _unlearn(tmp_path / "fixed", copied).train()
    assert any(not torch.equal(p, before[n]) for n, p in copied.named_parameters())


def test_the_unlearning_reference_uses_the_shared_detection():
    from hf_stable.trainers.unlearning import reference

    assert reference.own_forward is nograd.own_forward
    assert not hasattr(reference, "_reaches_outside")

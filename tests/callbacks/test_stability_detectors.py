"""NoGradientCallback, GRPODegenerateRunCallback and ComponentClipCallback on plain TRL/transformers trainers."""

import copy
import logging
import math

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.callbacks import (
    ComponentClipCallback,
    FaultInjectionCallback,
    GRPODegenerateRunCallback,
    NoGradientCallback,
    NoGradientError,
)
from hf_stable.stability import clip as clip_math
from hf_stable.testing import arithmetic_dataset, build_tiny_model


def _token_rows(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(10, 60, (n, 12), generator=g)]


def _plain_trainer(model, tmp_path, steps=3, **kw):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no",
                             disable_tqdm=True, logging_steps=1, **kw)
    return Trainer(model=model, args=args, train_dataset=_token_rows())


def _sft(model, tokenizer, tmp_path, steps=3, **kw):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
                     use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
                     logging_steps=1, max_length=32, gradient_checkpointing=False, **kw)
    return SFTTrainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=arithmetic_dataset(64, seed=0, max_operand=99))


# -- no gradient ---------------------------------------------------------------------------------------------
def test_deepcopy_of_an_sft_patched_model_raises_naming_the_fused_forward(tmp_path):
    model, tokenizer = build_tiny_model(seed=0)
    sft = _sft(model, tokenizer, tmp_path / "sft", steps=2)
    sft.train()
    copied = copy.deepcopy(sft.model)  # keeps TRL's instance-level forward, whose closure calls `model`
    before = {n: p.detach().clone() for n, p in copied.named_parameters()}

    trainer = _plain_trainer(copied, tmp_path / "copy")
    NoGradientCallback.attach(trainer)
    with pytest.raises(NoGradientError) as error:
        trainer.train()
    message = str(error.value)
    assert "_fused_forward" in message and "trl/trainer/utils.py" in message and "deepcopy" in message
    assert all(torch.equal(p, before[n]) for n, p in copied.named_parameters())  # raised before the first update

    # the fix the message gives: drop the instance forward, and the copy trains
    del copied.forward
    trainer = _plain_trainer(copied, tmp_path / "fixed")
    NoGradientCallback.attach(trainer)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in copied.named_parameters())


def test_without_the_detector_the_deepcopy_trap_is_silent(tmp_path):
    model, tokenizer = build_tiny_model(seed=0)
    _sft(model, tokenizer, tmp_path / "sft", steps=1)
    copied = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in copied.named_parameters()}
    trainer = _plain_trainer(copied, tmp_path / "copy")
    trainer.train()  # no error: the trap this detector exists for
    assert all(torch.equal(p, before[n]) for n, p in copied.named_parameters())
    assert trainer.state.log_history[0]["grad_norm"] == 0.0


def test_frozen_model_raises_before_the_first_update(tmp_path):
    model, tokenizer = build_tiny_model(seed=0)
    model.requires_grad_(False)
    trainer = _sft(model, tokenizer, tmp_path)
    NoGradientCallback.attach(trainer)
    with pytest.raises(NoGradientError, match="frozen model"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_exactly_zero_gradients_are_not_an_error(tmp_path):
    model, _ = build_tiny_model(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _plain_trainer(model, tmp_path, steps=1, optim="sgd", weight_decay=0.0)
    NoGradientCallback.attach(trainer)
    FaultInjectionCallback.attach(trainer, kind="loss_scale", steps=[1], factor=0.0)
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- degenerate GRPO runs ------------------------------------------------------------------------------------
def _grpo(tmp_path, reward_funcs, steps=6, **config):
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = build_tiny_model(seed=0)
    prompts = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)])
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
                      learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                      bf16=False, beta=0.0, gradient_checkpointing=False, disable_tqdm=True, seed=0,
                      **{"max_completion_length": 4, **config})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=prompts,
                          processing_class=tokenizer)
    return trainer, GRPODegenerateRunCallback.attach(trainer)


def _warnings(callback, kind):
    return [step for step, f in callback.findings if f.kind == kind and f.level == "warning"]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def test_truncation_warning_once_per_patience_window(tmp_path, caplog):
    tokenizer = build_tiny_model(seed=0)[1]
    trainer, callback = _grpo(tmp_path, [length_reward], max_completion_length=2,
                              generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]})
    with caplog.at_level(logging.WARNING, logger="hf_stable.callbacks.stability"):
        trainer.train()
    ratios = [h["completions/clipped_ratio"] for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    assert ratios == [1.0] * 6
    assert _warnings(callback, "truncated") == [3, 6]
    assert caplog.text.count("max_completion_length=2") == 2
    assert "Raise `max_completion_length`" in caplog.text


def test_constant_reward_warnings_once_per_patience_window(tmp_path, caplog):
    trainer, callback = _grpo(tmp_path, [constant_reward])
    with caplog.at_level(logging.WARNING, logger="hf_stable.callbacks.stability"):
        trainer.train()
    assert _warnings(callback, "zero_std") == [3, 6]
    assert _warnings(callback, "constant_reward") == [3, 6]
    assert _warnings(callback, "dead_run") == [3, 6]  # loss 0 and grad_norm 0: nothing moves
    assert "num_generations" in caplog.text and "reward functions returned one constant" in caplog.text


def test_on_policy_grpo_zero_loss_is_explained_once_at_info(tmp_path, caplog):
    trainer, callback = _grpo(tmp_path, [length_reward], loss_type="grpo", steps=4)
    with caplog.at_level(logging.INFO, logger="hf_stable.callbacks.stability"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert any(h["loss"] == 0.0 and h["grad_norm"] > 0 for h in logs)
    infos = [f for _, f in callback.findings if f.kind == "zero_loss_expected"]
    assert len(infos) == 1 and infos[0].level == "info"
    assert "expected, not a bug" in caplog.text
    assert not [f for _, f in callback.findings if f.level == "warning"]


# -- component-wise clipping ---------------------------------------------------------------------------------
class _GradProbe(TrainerCallback):
    """Records per-parameter gradients at on_pre_optimizer_step (raw, if added before the clip) and at
    on_optimizer_step (after every callback)."""

    def __init__(self, when):
        self.when, self.grads = when, []

    def _record(self, model):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.when == "pre":
            self._record(model)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.when == "post":
            self._record(model)


def test_param_groups_bound_every_gradient_and_then_global_follows_the_authors_order(tmp_path):
    model, _ = build_tiny_model(seed=0)
    trainer = _plain_trainer(model, tmp_path, steps=3, max_grad_norm=0.0)
    raw = _GradProbe("pre")
    trainer.add_callback(raw)
    clip = ComponentClipCallback.attach(trainer, max_norm=0.05, groups="param", then_global_max_norm=0.2)
    after = _GradProbe("post")
    trainer.add_callback(after)
    trainer.train()
    for before, clipped in zip(raw.grads, after.grads, strict=True):
        expected = {}
        for name, g in before.items():  # the authors' loop: clip each parameter, then clip globally
            norm = float(g.norm())
            expected[name] = g * min(1.0, 0.05 / (norm + 1e-6))
        total = math.sqrt(sum(float(g.pow(2).sum()) for g in expected.values()))
        scale = min(1.0, 0.2 / (total + 1e-6))
        for name, g in clipped.items():
            assert torch.allclose(g, expected[name] * scale, atol=1e-7), name
            assert float(g.norm()) <= 0.05 + 1e-6
    logs = [h for h in trainer.state.log_history if "stable/clip/frac_groups_clipped" in h]
    frac = sum(float(g.norm()) > 0.05 for g in raw.grads[-1].values()) / len(raw.grads[-1])
    assert logs[-1]["stable/clip/frac_groups_clipped"] == pytest.approx(frac)
    largest = max(float(g.norm()) for g in raw.grads[-1].values())
    assert logs[-1]["stable/clip/max_group_norm"] == pytest.approx(largest)
    assert clip.steps == 3


def test_adaptive_mode_follows_adagc_step_by_step(tmp_path):
    model, _ = build_tiny_model(seed=0)
    trainer = _plain_trainer(model, tmp_path, steps=5, max_grad_norm=0.0)
    raw = _GradProbe("pre")
    trainer.add_callback(raw)
    ComponentClipCallback.attach(trainer, mode="adaptive", groups="layer", adaptive_warmup_steps=2,
                                 adaptive_lambda_abs=0.5, adaptive_lambda_rel=1.05, adaptive_beta=0.9)
    after = _GradProbe("post")
    trainer.add_callback(after)
    trainer.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = clip_math.group_parameters([(n, None) for n in names], "layer")
    gamma = torch.full((len(groups),), math.inf)
    for step, (before, clipped) in enumerate(zip(raw.grads, after.grads, strict=True), start=1):
        norms = torch.stack([torch.sqrt(sum(before[n].pow(2).sum() for n, _ in members))
                             for members in groups.values()])
        coef, gamma = clip_math.adagc_coefficients(norms, gamma, step, warmup_steps=2, lambda_abs=0.5,
                                                   lambda_rel=1.05, beta=0.9)
        for c, members in zip(coef, groups.values(), strict=True):
            for n, _ in members:
                assert torch.allclose(clipped[n], before[n] * c, atol=1e-7), (step, n)


def test_component_clip_refuses_then_global_with_the_trainers_clip(tmp_path):
    model, _ = build_tiny_model(seed=0)
    trainer = _plain_trainer(model, tmp_path, steps=1, max_grad_norm=1.0)
    ComponentClipCallback.attach(trainer, then_global_max_norm=1.0)
    with pytest.raises(ValueError, match="needs `max_grad_norm=0`"):
        trainer.train()
    with pytest.raises(ValueError, match="`groups`"):
        ComponentClipCallback(groups="block")

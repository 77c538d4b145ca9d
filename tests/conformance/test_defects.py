"""Regression tests of four places where our trainers answered a TRL user differently from TRL's own trainers, with
every hf_stable flag at its default: an environment-owned reward (`reward_funcs=None`), non-LoRA PEFT methods at the
first save, `compute_loss` called after `train()`, and a deep copy of a model TRL's `SFTTrainer` trained. Each failed
before its fix."""

import copy
import logging
import os

import pytest
import torch
from conformance_helpers import TOOL_TEMPLATE, CountingEnv, peft_configs
from grpo_helpers import GRPO_ARGS, deterministic_rollout
from sft_helpers import STEP_ARGS, train_and_diff
from transformers import Trainer, TrainingArguments
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from unlearn_helpers import STEP_ARGS as UNLEARN_ARGS
from unlearn_helpers import split_data

from hf_stable import (
    StableGRPOConfig,
    StableGRPOTrainer,
    StableSFTConfig,
    StableSFTTrainer,
    UnlearningConfig,
    UnlearningTrainer,
)
from hf_stable.callbacks import NoGradientCallback, NoGradientError
from hf_stable.stability import nograd
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


# -- reward_funcs=None: the environment owns the reward ----------------------------------------------------------


def _env_run(tmp_path, trainer_cls, config_cls, reward_funcs=None, environment_factory=CountingEnv):
    CountingEnv.start()
    model, tokenizer = build_tiny_model(seed=0)
    tokenizer.chat_template = TOOL_TEMPLATE
    args = config_cls(str(tmp_path), per_device_train_batch_size=8, **{**GRPO_ARGS, "max_completion_length": 3})
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=arithmetic_dataset(8, conversational=True),
        processing_class=tokenizer,
        environment_factory=environment_factory,
    )
    return train_and_diff(trainer), trainer


def test_environment_owned_reward_with_reward_funcs_none_is_trls_update(tmp_path):
    trl, trl_trainer = _env_run(tmp_path / "trl", GRPOTrainer, GRPOConfig)
    ours, trainer = _env_run(tmp_path / "ours", StableGRPOTrainer, StableGRPOConfig)
    assert trainer.reward_func_names == ["CountingEnv"]
    assert trl.abs().max() > 0 and torch.equal(ours, trl)
    logged = {k: v for k, v in trainer.state.log_history[0].items() if k != "step_time"}
    assert logged == {k: v for k, v in trl_trainer.state.log_history[0].items() if k != "step_time"}
    assert logged["rewards/CountingEnv/std"] > 0


def test_no_reward_source_is_trls_own_error(tmp_path):
    class NoReward:
        def reset(self, **kwargs):
            return None

    messages = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (StableGRPOTrainer, StableGRPOConfig)):
        with pytest.raises(ValueError) as error:
            _env_run(tmp_path / trainer_cls.__name__, trainer_cls, config_cls, environment_factory=NoReward)
        messages.append(str(error.value))
    assert messages[0].startswith("No reward source provided") and messages[1] == messages[0]


# -- every PEFT method trains, saves, writes a card and reloads ----------------------------------------------------

PEFT = peft_configs()


def _peft_trainer(kind, peft_config, out):
    model, tokenizer = build_tiny_model(seed=0)
    save = {"max_steps": 1, "save_strategy": "steps", "save_steps": 1, "learning_rate": 1e-2}
    torch.manual_seed(0)
    if kind == "sft":
        args = StableSFTConfig(out, **{**STEP_ARGS, **save, "per_device_train_batch_size": 4})
        data = arithmetic_dataset(4, seed=1)
        return StableSFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config
        )
    if kind == "grpo":
        args = StableGRPOConfig(
            out, **{**GRPO_ARGS, **save, "per_device_train_batch_size": 4, "max_completion_length": 3}
        )
        return StableGRPOTrainer(
            model=model,
            reward_funcs=[arithmetic_reward],
            args=args,
            train_dataset=arithmetic_dataset(4, max_operand=9),
            processing_class=tokenizer,
            rollout_func=deterministic_rollout,
            peft_config=peft_config,
        )
    forget, retain = split_data(n_forget=4, n_retain=4)
    args = UnlearningConfig(out, **{**UNLEARN_ARGS, **save, "per_device_train_batch_size": 4})
    return UnlearningTrainer(
        model=model,
        args=args,
        forget_dataset=forget,
        retain_dataset=retain,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


# `StableSFTTrainer` and `StableGRPOTrainer` are checked the same way by the PEFT cases of test_trl_parity.py (each
# also against TRL's update); `UnlearningTrainer` has no TRL counterpart, so it is checked here.
@pytest.mark.parametrize("kind", ["unlearning"])
@pytest.mark.parametrize("method", sorted(PEFT))
def test_every_peft_method_trains_saves_writes_a_card_and_reloads(tmp_path, kind, method):
    from peft import PeftModel

    out = str(tmp_path / "out")
    trainer = _peft_trainer(kind, PEFT[method](), out)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()  # saves checkpoint-1 (SFT and GRPO write the card there too)
    trainer.create_model_card()
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert f"variant: {method}" in card, card
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)

    reloaded = PeftModel.from_pretrained(build_tiny_model(seed=0)[0], os.path.join(out, "checkpoint-1"))
    ids = torch.tensor([[9, 10, 11, 12, 13]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


# -- compute_loss after train() -----------------------------------------------------------------------------------


def _sft(tmp_path, trainer_cls, config_cls, model=None, **config):
    model, tokenizer = model or build_tiny_model(seed=0)
    args = config_cls(str(tmp_path), **{**STEP_ARGS, "max_steps": 1, "learning_rate": 1e-2, **config})
    data = arithmetic_dataset(8, seed=1)
    return trainer_cls(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)


def _one_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


def test_compute_loss_after_train_is_trls(tmp_path):
    losses = []
    for trainer_cls, config_cls in ((SFTTrainer, SFTConfig), (StableSFTTrainer, StableSFTConfig)):
        trainer = _sft(tmp_path / trainer_cls.__name__, trainer_cls, config_cls, per_device_train_batch_size=8)
        trainer.train()
        losses.append(trainer.compute_loss(trainer.model, _one_batch(trainer)))
    assert torch.isfinite(losses[0]) and torch.equal(losses[1], losses[0])


def test_compute_loss_after_train_under_an_owned_objective(tmp_path):
    """hf_stable's own objective after training: the eval batch's `compute_loss` is what `evaluate` reports."""
    trainer = _sft(
        tmp_path, StableSFTTrainer, StableSFTConfig, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        sft_objective="prob_power", objective_alpha=0.5,
    )  # fmt: skip
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, next(iter(trainer.get_eval_dataloader())))
    assert "forward" not in trainer.model.__dict__  # the deep-copy protection holds
    assert loss.item() == pytest.approx(trainer.evaluate()["eval_loss"], rel=1e-6)


# -- the deep-copy trap, repaired by our trainers -------------------------------------------------------------------


def _trl_trained_copy(tmp_path):
    trainer = _sft(tmp_path / "trl-sft", SFTTrainer, SFTConfig)
    trainer.train()
    original = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    copied = copy.deepcopy(trainer.model)
    assert nograd.foreign_forwards(copied)[0][2] is trainer.model  # the trap is armed
    return copied, trainer.model, original


def _ours(kind, model, out):
    tokenizer = build_tiny_model(seed=0)[1]
    if kind == "sft":
        return _sft(out, StableSFTTrainer, StableSFTConfig, model=(model, tokenizer))
    if kind == "grpo":
        args = StableGRPOConfig(str(out), **{**GRPO_ARGS, "per_device_train_batch_size": 4})
        return StableGRPOTrainer(
            model=model, reward_funcs=[arithmetic_reward], args=args, processing_class=tokenizer,
            train_dataset=arithmetic_dataset(4, max_operand=9), rollout_func=deterministic_rollout,
        )  # fmt: skip
    forget, retain = split_data(n_forget=4, n_retain=4)
    args = UnlearningConfig(str(out), **{**UNLEARN_ARGS, "per_device_train_batch_size": 4})
    return UnlearningTrainer(
        model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tokenizer
    )


@pytest.mark.parametrize("kind", ["sft", "grpo", "unlearning"])
def test_our_trainers_repair_a_deepcopy_of_a_trl_trained_model(tmp_path, caplog, kind):
    copied, original_model, original = _trl_trained_copy(tmp_path)
    before = {n: p.detach().clone() for n, p in copied.named_parameters()}
    with caplog.at_level(logging.INFO, logger="hf_stable.stability.nograd"):
        trainer = _ours(kind, copied, tmp_path / kind)
    repaired = [r for r in caplog.records if r.name == "hf_stable.stability.nograd"]
    assert len(repaired) == 1 and "removed TRL's fused LM-head forward" in repaired[0].getMessage()
    assert not nograd.foreign_forwards(copied)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in copied.named_parameters())
    assert all(torch.equal(p, original[n]) for n, p in original_model.named_parameters())


def _plain_trainer(model, out, callbacks):
    tokenizer = build_tiny_model(seed=0)[1]
    rows = [tokenizer(r["prompt"] + r["completion"])["input_ids"] for r in arithmetic_dataset(4, seed=1)]
    width = max(map(len, rows))
    batch = [{"input_ids": r + [tokenizer.pad_token_id] * (width - len(r)), "labels": r + [-100] * (width - len(r))}
             for r in rows]  # fmt: skip
    args = TrainingArguments(
        str(out), max_steps=1, per_device_train_batch_size=4, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, learning_rate=1e-2,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=batch, callbacks=callbacks)


def test_plain_trainers_and_unrepairable_causes_still_raise(tmp_path):
    copied, _, _ = _trl_trained_copy(tmp_path)
    with pytest.raises(NoGradientError, match="_fused_forward"):  # a plain trainer does not repair
        _plain_trainer(copied, tmp_path / "plain", [NoGradientCallback()]).train()

    # a foreign forward that is not TRL's: we cannot know what it is for, so it is left and the check names it
    model, other = build_tiny_model(seed=0)[0], build_tiny_model(seed=1)[0]
    model.forward = lambda *a, **k: other(*a, **k)
    forget, retain = split_data(n_forget=4, n_retain=4)
    args = UnlearningConfig(str(tmp_path / "u"), **{**UNLEARN_ARGS, "per_device_train_batch_size": 4})
    trainer = UnlearningTrainer(model=model, args=args, forget_dataset=forget, retain_dataset=retain,
                                processing_class=build_tiny_model(seed=0)[1])  # fmt: skip
    assert "forward" in model.__dict__
    with pytest.raises(NoGradientError, match="was replaced on the instance"):
        trainer.train()

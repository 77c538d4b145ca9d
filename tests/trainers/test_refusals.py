"""Settings every hf_stable trainer refuses at construction, by name, as transformers would accept and ignore them:
fp16 on a CPU, a run that cannot take a step, and DMM's precomputed targets missing from the forget rows."""

import pytest
import torch
from unlearn_helpers import STEP_ARGS as UNLEARN_ARGS
from unlearn_helpers import split_data

from hf_stable import StableGRPOConfig, StableGRPOTrainer, StableSFTConfig, StableSFTTrainer
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model
from hf_stable.trainers.unlearning import UnlearningConfig, UnlearningTrainer, precompute_dmm_targets


def _sft(tmp_path, **config):
    model, tok = build_tiny_model(seed=0)
    args = StableSFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **config)
    return StableSFTTrainer(model=model, args=args, train_dataset=arithmetic_dataset(8), processing_class=tok)


def _grpo(tmp_path, **config):
    model, tok = build_tiny_model(seed=0)
    args = StableGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2, per_device_train_batch_size=2,
        max_completion_length=4, **config,
    )
    return StableGRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=arithmetic_dataset(8),
        processing_class=tok,
    )


def _unlearning(tmp_path, forget=None, **config):
    model, tok = build_tiny_model(seed=0)
    default_forget, retain = split_data()
    args = UnlearningConfig(output_dir=str(tmp_path), **{**UNLEARN_ARGS, **config})
    return UnlearningTrainer(
        model=model, args=args, forget_dataset=forget or default_forget, retain_dataset=retain, processing_class=tok
    )


TRAINERS = {"sft": _sft, "grpo": _grpo, "unlearning": _unlearning}


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_fp16_on_a_cpu_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=r"fp16=True has no effect on a CPU.*bf16=True"):
        TRAINERS[name](tmp_path, fp16=True, max_steps=1)


def test_fp16_on_a_cpu_is_ignored_by_accelerate(tmp_path):
    """Why it is refused rather than honoured: transformers' own Trainer accepts it and gets neither autocast nor a
    GradScaler, so the run is fp32. If accelerate starts honouring fp16 on a CPU this fails and the refusal can go."""
    from transformers import Trainer, TrainingArguments

    model, _ = build_tiny_model(seed=0)
    args = TrainingArguments(str(tmp_path), fp16=True, use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args)
    assert trainer.accelerator.device.type == "cpu"
    assert not trainer.accelerator.native_amp and trainer.accelerator.scaler is None
    bf16 = Trainer(model=model, args=TrainingArguments(str(tmp_path), bf16=True, use_cpu=True, report_to="none"))
    assert bf16.accelerator.native_amp  # bf16 autocast, the alternative the refusal names, does run on a CPU


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_a_run_that_cannot_take_a_step_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=r"max_steps=-5 and num_train_epochs=0(\.0)?: the run cannot take a step"):
        TRAINERS[name](tmp_path, max_steps=-5, num_train_epochs=0)


def test_epoch_and_step_bounded_runs_are_accepted(tmp_path):
    """max_steps=-1 with epochs > 0 is the ordinary epoch run; max_steps > 0 wins over epochs=0."""
    trainer = _sft(tmp_path / "a", max_steps=-1, num_train_epochs=1, per_device_train_batch_size=8, max_length=32)
    trainer.train()
    assert trainer.state.global_step == 1
    trainer = _sft(tmp_path / "b", max_steps=2, num_train_epochs=0, per_device_train_batch_size=4, max_length=32)
    trainer.train()
    assert trainer.state.global_step == 2


def test_dmm_precomputed_without_targets_is_refused(tmp_path):
    """Without targets the forget rows would be matched to the starting model: a loss of ~0 that unlearns nothing."""
    with pytest.raises(ValueError, match=r"dmm_target='precomputed' needs `dmm_target_ids`.* 8 of 8 row\(s\)"):
        _unlearning(tmp_path, unlearn_method="dmm", dmm_target="precomputed")


def test_dmm_precomputed_with_a_row_missing_its_targets_is_refused(tmp_path):
    forget, _ = split_data()
    oracle, tok = build_tiny_model(seed=1)
    targets = precompute_dmm_targets(oracle, forget, tok, k=4)
    rows = [dict(row) for row in targets]
    rows[3]["dmm_target_ids"] = rows[3]["dmm_target_logps"] = None
    with pytest.raises(ValueError, match=r"1 of 8 row\(s\) have none \(rows 3\)"):
        _unlearning(tmp_path, forget=rows, unlearn_method="dmm", dmm_target="precomputed")
    trainer = _unlearning(tmp_path, forget=targets, unlearn_method="dmm", dmm_target="precomputed")
    batch = next(iter(trainer.get_train_dataloader()))
    assert trainer.compute_loss(trainer.model, batch).abs().item() > 1e-3  # the targets are used: a real loss


def test_precomputed_targets_refuse_a_forget_batch_without_them():
    from hf_stable.trainers.unlearning.targets import PrecomputedTargets

    targets = PrecomputedTargets(10, reference=lambda stream: torch.zeros(1))
    stream = {"labels": torch.zeros(1, 3, dtype=torch.long), "input_ids": torch.zeros(1, 3, dtype=torch.long)}
    assert targets(stream, "retain").shape == (1,)  # retain rows fall back to the reference
    with pytest.raises(ValueError, match="the forget rows carry no dmm_target_ids"):
        targets(stream, "forget")

"""MAP and sine adapters under `StableSFTTrainer` and `StableGRPOTrainer`: they train, accumulation does not change
the update, the MAP scalars get their own learning rate and no weight decay, and a 4-bit base trains too."""

import math

import pytest
import torch
from adapter_cases import CASES, adapter_config
from grpo_helpers import grpo_run
from sft_helpers import GLOBAL_BATCH, assert_same_update, one_step_update

from hf_stable.adapters.optim import map_parameter_names


ADAM = dict(max_steps=2, optim="adamw_torch", learning_rate=1e-2)


def _trainable(trainer):
    return {n for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", CASES)
def test_sft_trains_every_adapter_parameter(tmp_path, kind):
    update, trainer = one_step_update(tmp_path, GLOBAL_BATCH, 1, peft_config=adapter_config(kind), **ADAM)
    names = _trainable(trainer)
    assert names and all("lora_" in n for n in names), "only adapter parameters may train"
    if kind == "map":
        assert any("lora_map_a" in n for n in names) and any("lora_map_b" in n for n in names)
    sizes = [p.numel() for n, p in trainer.model.named_parameters() if n in names]
    moved = [chunk.abs().max().item() > 0 for chunk in update.split(sizes)]
    assert all(moved), f"{moved.count(False)} of {len(moved)} adapter tensors did not move in two steps"


@pytest.mark.parametrize("kind", CASES)
def test_grpo_trains_every_adapter_parameter(tmp_path, kind):
    update, trainer = grpo_run(tmp_path, peft_config=adapter_config(kind), **ADAM)
    names = _trainable(trainer)
    sizes = [p.numel() for n, p in trainer.model.named_parameters() if n in names]
    moved = [chunk.abs().max().item() > 0 for chunk in update.split(sizes)]
    assert all(moved), f"{moved.count(False)} of {len(moved)} adapter tensors did not move in two steps"
    assert math.isfinite(trainer.state.log_history[-2]["loss"])


@pytest.mark.parametrize("kind", CASES)
def test_sft_accumulation_gives_the_same_update(tmp_path, kind):
    full, _ = one_step_update(tmp_path / "a", GLOBAL_BATCH, 1, peft_config=adapter_config(kind))
    accumulated, _ = one_step_update(tmp_path / "b", GLOBAL_BATCH // 4, 4, peft_config=adapter_config(kind))
    assert_same_update(accumulated, full)


@pytest.mark.parametrize("kind", CASES)
def test_grpo_accumulation_gives_the_same_update(tmp_path, kind):
    full, _ = grpo_run(tmp_path / "a", peft_config=adapter_config(kind))
    accumulated, _ = grpo_run(tmp_path / "b", batch_size=4, grad_accum=2, peft_config=adapter_config(kind))
    assert_same_update(accumulated, full)


def test_map_scalar_lr_scales_only_the_scalars(tmp_path):
    """Plain SGD, one step: the scalars move by `map_scalar_lr/lr` times their default step, A and B not at all
    (β = 0 at initialisation, so their gradient is exactly 0 on the first step)."""
    base, trainer = one_step_update(tmp_path / "a", GLOBAL_BATCH, 1, peft_config=adapter_config("map"))
    config = adapter_config("map")
    config.map_scalar_lr = 0.25
    scaled, _ = one_step_update(tmp_path / "b", GLOBAL_BATCH, 1, peft_config=config)
    scalars, factors = map_parameter_names(trainer.model)
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    sizes = [dict(trainer.model.named_parameters())[n].numel() for n in names]
    by_name = dict(zip(names, zip(base.split(sizes), scaled.split(sizes), strict=True), strict=True))
    assert set(by_name) == scalars | factors
    for name in scalars:
        b, s = by_name[name]
        assert b.abs().item() > 0, f"{name} did not move"
        torch.testing.assert_close(s, 0.25 * b, rtol=1e-5, atol=0)
    for name in factors:
        assert all(t.abs().max().item() == 0 for t in by_name[name])


def test_map_parameters_get_no_weight_decay(tmp_path):
    config = adapter_config("map")
    config.map_scalar_lr = 3e-3
    _, trainer = one_step_update(tmp_path, GLOBAL_BATCH, 1, peft_config=config, weight_decay=0.1)
    scalars, factors = map_parameter_names(trainer.model)
    named = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = [
        (g["lr"], g["weight_decay"], {named[id(p)] for p in g["params"]}) for g in trainer.optimizer.param_groups
    ]
    assert {n for _, wd, names in groups if wd > 0 for n in names}.isdisjoint(scalars | factors)
    scalar_groups = [(lr, wd) for lr, wd, names in groups if names & scalars]
    assert scalar_groups == [(3e-3, 0.0)] and all(names <= scalars for lr, _, names in groups if names & scalars)


@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    from hf_stable.testing import build_tiny_model

    path = tmp_path_factory.mktemp("nf4-base")
    build_tiny_model(save_dir=path)
    return str(path)


def _nf4(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant)


@pytest.mark.parametrize("trainer_name", ["sft", "grpo"])
def test_map_trains_on_a_4bit_base(tmp_path, nf4_model_dir, trainer_name):
    """QLoRA path: a bitsandbytes nf4 base under MAP trains the adapter and leaves the 4-bit weights untouched."""
    import bitsandbytes as bnb

    from hf_stable import StableGRPOConfig, StableGRPOTrainer, StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_tokenizer

    model, tokenizer = _nf4(nf4_model_dir), build_tiny_tokenizer()
    quantised = {n: m.weight.data.clone() for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantised
    torch.manual_seed(0)
    if trainer_name == "sft":
        from sft_helpers import STEP_ARGS

        args = StableSFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **{**STEP_ARGS, **ADAM})
        trainer = StableSFTTrainer(
            model=model,
            args=args,
            train_dataset=arithmetic_dataset(8, seed=1),
            processing_class=tokenizer,
            peft_config=adapter_config("map"),
        )
    else:
        from grpo_helpers import GRPO_ARGS, deterministic_rollout

        args = StableGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, **{**GRPO_ARGS, **ADAM})
        trainer = StableGRPOTrainer(
            model=model,
            reward_funcs=[arithmetic_reward],
            args=args,
            train_dataset=arithmetic_dataset(16, seed=0, max_operand=9),
            processing_class=tokenizer,
            peft_config=adapter_config("map"),
            rollout_func=deterministic_rollout,
        )
    layers = [m for m in trainer.model.modules() if hasattr(m, "lora_map_a")]
    assert layers and all(isinstance(m.get_base_layer(), bnb.nn.Linear4bit) for m in layers)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all((after[n] - before[n]).abs().max() > 0 for n in before), "an adapter tensor did not move"
    for name, module in trainer.model.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = name.removesuffix(".base_layer")
            assert torch.equal(module.weight.data, quantised[key]), f"{key}: 4-bit weight changed"


@pytest.mark.parametrize("kind", CASES)
def test_model_card_names_the_adapter_and_how_to_load_it(tmp_path, kind):
    _, trainer = one_step_update(tmp_path, GLOBAL_BATCH, 1, peft_config=adapter_config(kind))
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert ("2505.23094" in card) == (kind == "map") and ("2509.24166" in card) == (kind == "sine")
    assert "load_adapter" in card and f"variant: {kind}" in card


@pytest.mark.parametrize("kind", CASES)
def test_resume_from_an_adapter_checkpoint_continues_exactly(tmp_path, kind):
    """`Trainer` resumes a PEFT model through `PeftModel.load_adapter` on the checkpoint folder, i.e. through the
    saved `peft_type` marker: 1 step + resume + 1 step ends where 2 uninterrupted steps do."""
    import json

    from sft_helpers import STEP_ARGS, dataset_for

    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable._peft_hook import SAVED_PEFT_TYPE
    from hf_stable.testing import build_tiny_model

    def trainer(out, **overrides):
        model, tokenizer = build_tiny_model(seed=0)
        args = StableSFTConfig(
            output_dir=str(out), per_device_train_batch_size=GLOBAL_BATCH, **{**STEP_ARGS, **ADAM, **overrides}
        )
        torch.manual_seed(0)
        return StableSFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset_for({}),
            processing_class=tokenizer,
            peft_config=adapter_config(kind),
        )

    def adapter_state(t):
        return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}

    straight = trainer(tmp_path / "straight")
    straight.train()
    interrupted = trainer(tmp_path / "cut", save_strategy="steps", save_steps=1, max_steps=1)
    interrupted.train()
    saved = json.loads((tmp_path / "cut" / "checkpoint-1" / "adapter_config.json").read_text())
    assert saved["peft_type"] == SAVED_PEFT_TYPE
    resumed = trainer(tmp_path / "cut", save_strategy="steps", save_steps=1)
    start = adapter_state(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    expected, actual = adapter_state(straight), adapter_state(resumed)
    assert set(actual) == set(expected)
    assert any(not torch.equal(start[n], actual[n]) for n in actual)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7)

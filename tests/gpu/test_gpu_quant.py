"""bitsandbytes 4-bit on CUDA: a QLoRA training step, MAP on an nf4 base, and the dequantising merged export."""

import os

import pytest
import torch
from gpu_helpers import GPU


pytestmark = GPU


def load_nf4(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    pytest.importorskip("bitsandbytes")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map={"": 0})


def _train(model, tokenizer, tmp_path, peft_config, steps=3):
    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import arithmetic_dataset

    args = StableSFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        max_length=32,
        gradient_checkpointing=False,
        logging_steps=1,
        bf16=True,
        use_cpu=False,
    )
    trainer = StableSFTTrainer(
        model=model,
        args=args,
        train_dataset=arithmetic_dataset(64, seed=0),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n].detach())]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, before, changed, losses


@pytest.mark.parametrize("variant", ["lora", "map"])
def test_qlora_step_on_cuda(tiny_model_dir, tmp_path, variant):
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_stable.adapters import StableLoraConfig

    model = load_nf4(tiny_model_dir)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    config = (
        LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM")
        if variant == "lora"
        else StableLoraConfig(r=8, target_modules="all-linear", use_map=True)
    )
    _, before, changed, losses = _train(model, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path, config)
    assert (before and len(changed) == len(before)) or variant == "map"  # MAP's A/B wait one step for β
    assert changed and all(torch.isfinite(torch.tensor(losses)))
    assert all("lora" in n for n in before), "only adapter parameters train on a 4-bit base"


def test_map_on_nf4_merged_export_reproduces_the_adapter(tiny_model_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable.adapters import StableLoraConfig, merge_and_export

    model = load_nf4(tiny_model_dir)
    config = StableLoraConfig(r=8, target_modules="all-linear", use_map=True, lora_dropout=0.0)
    trainer, _, changed, _ = _train(model, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path, config, steps=4)
    assert changed
    peft_model = trainer.model
    peft_model.train()  # dropout is 0; the train-mode path dequantises exactly
    ids = torch.randint(7, peft_model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        logits = peft_model(input_ids=ids.cuda()).logits.float().cpu()
    out = tmp_path / "export"
    result = merge_and_export(peft_model, str(out))
    assert result["dequantized"] is True
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(out).cuda().eval()
    assert not any(type(m).__module__.startswith("bitsandbytes") for m in exported.modules())
    with torch.no_grad():
        merged = exported(input_ids=ids.cuda()).logits.float().cpu()
    # bf16 compute in the 4-bit layers vs fp32 in the exported model
    torch.testing.assert_close(merged, logits, atol=5e-2, rtol=5e-2)
    assert os.path.isfile(out / "model.safetensors")

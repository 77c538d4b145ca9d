"""Step time and training memory of MAP and sine adapters against PEFT's LoRA and DoRA at equal rank, measured side by
side in one run.

Setup: a Llama-architecture model built from config (`--hidden`, 4 layers, character tokenizer), adapters of rank
`--rank` on every linear layer (sine also with the reference's MLP-only placement, against PEFT LoRA on the same
layers), one fixed batch of `--batch_size` × `--seq_len` random tokens for every arm, AdamW, fp32, one CPU thread. A
plain loop (forward, backward, AdamW step) isolates the adapter's cost from trainer overhead. One step of PEFT LoRA
takes ≥ 100 ms of CPU (printed and stored).

Training memory = bytes saved for backward in one forward (counted exactly with `saved_tensors_hooks`, each storage
once) + the trainable parameters with their gradients and two AdamW moments; it is deterministic, so measured once per
arm.

Protocol and clocks: `benchmarks/_paired.py`, ratios against PEFT LoRA on all linear layers (the docs quote CPU
time: the machine is shared, see there).

    OMP_NUM_THREADS=1 python benchmarks/adapters_overhead.py            # the committed run
    OMP_NUM_THREADS=1 python benchmarks/adapters_overhead.py --quick --output_dir /tmp/x    # smoke
"""

from __future__ import annotations

import sys
import time

from _paired import StepClock, check_args, parser, quiet, report, run_paired, select_arms, summarise


MLP = ["gate_proj", "up_proj", "down_proj"]
ARMS = ("lora", "dora", "map", "sine", "sine_mlp", "lora_mlp")
BASELINE = "lora"
LABELS = {
    "lora": "PEFT LoRA (all linear)",
    "dora": "PEFT DoRA",
    "map": "hf_stable MAP",
    "sine": "hf_stable sine",
    "sine_mlp": "hf_stable sine (MLP only)",
    "lora_mlp": "PEFT LoRA (MLP only)",
}


def adapter_config(arm, rank):
    from peft import LoraConfig

    from hf_stable.adapters import StableLoraConfig

    return {
        "lora": lambda: LoraConfig(r=rank, target_modules="all-linear"),
        "dora": lambda: LoraConfig(r=rank, target_modules="all-linear", use_dora=True),
        "map": lambda: StableLoraConfig(r=rank, target_modules="all-linear", use_map=True),
        "sine": lambda: StableLoraConfig(r=rank, target_modules="all-linear", use_sine=True),
        "sine_mlp": lambda: StableLoraConfig(r=rank, target_modules=MLP, use_sine=True),
        "lora_mlp": lambda: LoraConfig(r=rank, target_modules=MLP),
    }[arm]()


def build(arm, cli):
    import torch
    from peft import get_peft_model

    from hf_stable.testing import build_tiny_model

    model, _ = build_tiny_model(seed=0, hidden_size=cli.hidden, intermediate_size=2 * cli.hidden, num_hidden_layers=4)
    torch.manual_seed(0)
    model = get_peft_model(model, adapter_config(arm, cli.rank))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4), params


def saved_bytes(model, batch):
    """Bytes of the tensors autograd keeps for backward over one forward, each storage counted once."""
    import torch

    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def memory(arm, cli, batch):
    model, _, params = build(arm, cli)
    state = sum(p.numel() * p.element_size() for p in params) * 4  # weights, grads, 2 AdamW moments
    return {"training_bytes": saved_bytes(model, batch) + state, "trainable": sum(p.numel() for p in params)}


def run_arm(arm, cli, batch):
    model, optimizer, _ = build(arm, cli)
    clock = StepClock()
    clock.stamp()
    for _ in range(cli.warmup + cli.steps):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.stamp()
    return clock.summary(cli.warmup)


def main(argv=None):
    p = parser(__doc__.splitlines()[0], repeats=8, steps=8, warmup=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--seq_len", type=int, default=64)
    cli = p.parse_args(argv)
    if cli.quick:
        cli.repeats, cli.steps, cli.warmup, cli.hidden, cli.batch_size, cli.seq_len = 2, 2, 1, 32, 2, 8
    check_args(cli)
    quiet()
    import torch

    from hf_stable.testing import build_tiny_tokenizer

    started = time.time()
    vocab = len(build_tiny_tokenizer())
    batch = torch.randint(3, vocab, (cli.batch_size, cli.seq_len), generator=torch.Generator().manual_seed(0))
    arms = select_arms(cli, ARMS, BASELINE)
    mem = {arm: memory(arm, cli, batch) for arm in arms}
    per_repeat = run_paired(
        arms, lambda arm: run_arm(arm, cli, batch), repeats=cli.repeats, baseline=BASELINE, seed=cli.seed
    )
    table = summarise(per_repeat, arms, BASELINE)
    for arm in arms:
        mem[arm]["ratio_vs_lora"] = mem[arm]["training_bytes"] / mem[BASELINE]["training_bytes"]
    setup = {
        "model": f"Llama hidden {cli.hidden}, 4 layers, intermediate {2 * cli.hidden}, vocab {vocab}",
        "adapters": f"rank {cli.rank}; all linear layers unless the arm says MLP only",
        "batch": f"{cli.batch_size} x {cli.seq_len} random tokens, the same for every arm",
        "optimizer": "AdamW lr 1e-4, fp32, plain loop",
        "labels": LABELS,
    }
    columns = {
        "trainable": lambda a: f"{mem[a]['trainable']:,}",
        "training memory vs lora": lambda a: (
            f"{mem[a]['ratio_vs_lora']:.2f} ({mem[a]['training_bytes'] / 2**20:.1f} MiB)"
        ),
    }
    notes = ["Arms: " + "; ".join(f"`{a}` {label}" for a, label in LABELS.items()) + "."]
    return report(
        "adapters_overhead",
        cli,
        setup=setup,
        table=table,
        per_repeat=per_repeat,
        arms=arms,
        baseline=BASELINE,
        targets={},
        started=started,
        notes=notes,
        extra_columns=columns,
        extra={"memory": mem},
    )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

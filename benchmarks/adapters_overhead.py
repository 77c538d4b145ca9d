"""Step time and training memory of MAP and sine adapters against PEFT's LoRA and DoRA at equal rank, in one run.

    python benchmarks/adapters_overhead.py [--steps 20] [--repeats 3] [--hidden 256] [--rank 8]

Same tiny Llama, data and seed for every row, adapters on every linear layer (sine: the reference's MLP-only
placement as a second row). A plain loop (forward, backward, AdamW step) isolates the adapter's cost from trainer
overhead; rows are interleaved and repeated so background load hits them alike. Reported per row: median ms per step,
and training memory = bytes saved for backward in one forward (counted exactly with `saved_tensors_hooks`, shared
storages once) + trainable parameters with their gradients and two AdamW moments. Ratios are against PEFT LoRA.
"""

import argparse
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model

from hf_stable.adapters import StableLoraConfig
from hf_stable.testing import build_tiny_model


MLP = ["gate_proj", "up_proj", "down_proj"]
ROWS = {
    "PEFT LoRA": lambda r: LoraConfig(r=r, target_modules="all-linear"),
    "PEFT DoRA": lambda r: LoraConfig(r=r, target_modules="all-linear", use_dora=True),
    "hf_stable MAP": lambda r: StableLoraConfig(r=r, target_modules="all-linear", use_map=True),
    "hf_stable sine": lambda r: StableLoraConfig(r=r, target_modules="all-linear", use_sine=True),
    "hf_stable sine (MLP only)": lambda r: StableLoraConfig(r=r, target_modules=MLP, use_sine=True),
    "PEFT LoRA (MLP only)": lambda r: LoraConfig(r=r, target_modules=MLP),
}


def build(name, hidden, rank):
    model, _ = build_tiny_model(seed=0, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4)
    torch.manual_seed(0)
    model = get_peft_model(model, ROWS[name](rank))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4), params


def saved_bytes(model, batch):
    """Bytes of the tensors autograd keeps for backward over one forward, each storage counted once."""
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


def time_steps(model, optimizer, batch, steps):
    for step in range(steps + 2):  # two warm-up steps
        if step == 2:
            start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return 1000 * (time.perf_counter() - start) / steps


def main(steps, repeats, hidden, rank, batch_size, seq_len):
    torch.set_num_threads(1)
    vocab = build_tiny_model(seed=0, hidden_size=hidden)[0].config.vocab_size
    batch = torch.randint(3, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in ROWS}
    memory, trainable = {}, {}
    for _ in range(repeats):
        for name in ROWS:
            model, optimizer, params = build(name, hidden, rank)
            if name not in memory:
                state = sum(p.numel() * p.element_size() for p in params) * 4  # weights, grads, 2 AdamW moments
                memory[name] = saved_bytes(model, batch) + state
                trainable[name] = sum(p.numel() for p in params)
            times[name].append(time_steps(model, optimizer, batch, steps))
    base_t, base_m = statistics.median(times["PEFT LoRA"]), memory["PEFT LoRA"]
    print(
        f"tiny Llama hidden {hidden}, 4 layers, rank {rank}, batch {batch_size}x{seq_len}, {steps} steps x "
        f"{repeats} interleaved repeats, 1 thread\n"
    )
    print(f"{'adapter':<27} {'trainable':>10} {'ms/step':>8} {'time':>6} {'memory MB':>10} {'memory':>7}")
    for name in ROWS:
        t = statistics.median(times[name])
        print(
            f"{name:<27} {trainable[name]:>10,} {t:>8.1f} {t / base_t:>5.2f}x {memory[name] / 2**20:>10.1f} "
            f"{memory[name] / base_m:>6.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    main(args.steps, args.repeats, args.hidden, args.rank, args.batch_size, args.seq_len)

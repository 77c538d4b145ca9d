"""Run under `accelerate launch --config_file <zero2|zero3|fsdp2>.yaml --num_processes N` on CUDA: the distributed
matrix's rows of one family under that backend, with the global batch split over the N processes. The main process
saves the updates (gathered from the shards under ZeRO-3 / FSDP2) to OUT/backend_updates.safetensors.

Usage: gpu_backend_script.py OUT ROW[,ROW...]. A hang dumps every stack and exits (faulthandler).
"""

import faulthandler
import os
import sys


faulthandler.dump_traceback_later(420, exit=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_helpers  # noqa: E402, F401  (puts the CPU suite's helpers on the path)
import grpo_helpers  # noqa: E402
import sft_helpers  # noqa: E402
import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hf_stable import distributed  # noqa: E402


def train_and_diff(trainer):
    """`sft_helpers.train_and_diff` for sharded parameters: the update of the full (gathered) weights."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    full = distributed.gather_full_state_dict(trainer.model, trainer.accelerator)
    if full is None:  # not the main process
        return torch.zeros(0)
    full = {k.removeprefix("module."): v for k, v in full.items()}
    return torch.cat([(full[n].to(before[n].device, torch.float32) - before[n].float()).flatten() for n in before])


# the shards are only complete after a gather: measure the update the same way for every row
sft_helpers.train_and_diff = grpo_helpers.train_and_diff = train_and_diff

from matrix_rows import run  # noqa: E402


def main(out_dir, names):
    state = PartialState()
    results = {}
    for name in names:
        out = run(name, out_dir, processes=state.num_processes, overrides={"use_cpu": False})
        results[name] = out["update"].detach().float().cpu().contiguous()
    if state.is_main_process:
        save_file(results, os.path.join(out_dir, "backend_updates.safetensors"))
    state.wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import end_rank

    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

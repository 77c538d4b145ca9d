"""Run under `accelerate launch --multi_gpu --num_processes 2`: one unlearning step per method, 2 processes × batch 4.
Rank 0 saves the updates; every rank checks the replicas agree."""

import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from unlearn_helpers import GLOBAL_BATCH, METHODS, unlearn_update


def main(out_dir, names):
    torch.set_num_threads(1)
    results = {}
    for name in names:
        delta, trainer = unlearn_update(os.path.join(out_dir, name), GLOBAL_BATCH // 2, 1, **METHODS[name])
        assert trainer.accelerator.num_processes == 2
        replicas = trainer.accelerator.gather(delta[None])
        assert torch.equal(replicas[0], replicas[1]), f"{name}: parameters differ between processes"
        results[name] = delta.contiguous()
    if PartialState().is_main_process:
        save_file(results, os.path.join(out_dir, "unlearn_updates.safetensors"))
    PartialState().wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()  # a hang dumps every stack and exits before the test's timeout
    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

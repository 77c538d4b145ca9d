"""Run under `accelerate launch --multi_gpu --num_processes 2`: one SFT step per objective, 2 processes x batch 4,
and 2 processes x batch 2 x accumulation 2. Rank 0 saves the updates; every rank checks the replicas agree."""

import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sft_helpers import GLOBAL_BATCH, OBJECTIVES, one_step_update


def main(out_dir, names):
    torch.set_num_threads(1)
    results = {}
    for name in names:
        for batch, accum in ((GLOBAL_BATCH // 2, 1), (GLOBAL_BATCH // 4, 2)):
            delta, trainer = one_step_update(os.path.join(out_dir, "run"), batch, accum, **OBJECTIVES[name])
            assert trainer.accelerator.num_processes == 2, (
                f"expected 2 processes, got {trainer.accelerator.num_processes}"
            )
            replicas = trainer.accelerator.gather(delta[None])
            assert torch.equal(replicas[0], replicas[1]), f"{name}: parameters differ between processes"
            if trainer._multipliers is not None:
                tables = trainer.accelerator.gather(trainer._multipliers[None])
                assert torch.equal(tables[0], tables[1]), f"{name}: multiplier tables differ between processes"
                results[f"{name}/ga{accum}/multipliers"] = trainer._multipliers.clone()
            results[f"{name}/ga{accum}"] = delta.contiguous()
    state = PartialState()  # initialised by the trainers' TrainingArguments (use_cpu=True: gloo)
    if state.is_main_process:
        save_file(results, os.path.join(out_dir, "updates.safetensors"))
    state.wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()  # a hang dumps every stack and exits before the test's timeout
    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

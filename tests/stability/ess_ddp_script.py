"""Run under `accelerate launch --multi_gpu --num_processes 2`: two GRPO steps with loss_mode="ess" on stale data
(num_iterations=2), 2 processes x batch G. Rank 0 saves the update and the last logged ESS."""

import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_helpers import G, grpo_run
from test_stability_ess import ESS_DDP


def main(out_dir):
    torch.set_num_threads(1)
    delta, trainer = grpo_run(os.path.join(out_dir, "run"), batch_size=G, **ESS_DDP)
    assert trainer.accelerator.num_processes == 2
    replicas = trainer.accelerator.gather(delta[None])
    assert torch.equal(replicas[0], replicas[1]), "parameters differ between processes"
    ess = [h["stable/ess/value"] for h in trainer.state.log_history if "stable/ess/value" in h][-1]
    if PartialState().is_main_process:
        save_file(
            {"update": delta.contiguous(), "ess": torch.tensor([ess])}, os.path.join(out_dir, "ess_update.safetensors")
        )
    PartialState().wait_for_everyone()


if __name__ == "__main__":
    from launch_helpers import end_rank

    main(sys.argv[1])
    end_rank()

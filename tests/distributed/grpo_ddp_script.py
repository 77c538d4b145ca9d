"""Run under `accelerate launch --multi_gpu --num_processes 2`: one GRPO step per variant with 2 processes x batch G
(one group each), deterministic rollouts. Rank 0 saves the updates and the advantages the step used."""

import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_helpers import G, grpo_run


VARIANTS = {
    "default": {},
    "sgrpo": {
        "advantage_estimator": "sgrpo",
        "sgrpo_noise_p": 0.1,
        "loss_type": "dr_grpo",
        "correctness_reward_index": 0,
    },
    "maxrl": {"advantage_estimator": "maxrl", "correctness_reward_index": 0},
    "dvao": {"advantage_estimator": "dvao"},
    "oblr": {"advantage_estimator": "oblr"},
    "delta_l": {"delta_l_alpha": 1.0, "loss_type": "dr_grpo"},
    "drpo": {"loss_mode": "drpo", "correctness_reward_index": 0},
    "onpolicy_sft": {"loss_mode": "onpolicy_sft", "correctness_reward_index": 0},
    "ctwa": {"reward_weighting": "ctwa", "max_steps": 2},
}


def main(out_dir, names):
    torch.set_num_threads(1)
    results = {}
    for name in names:
        delta, trainer = grpo_run(os.path.join(out_dir, "run"), batch_size=G, **VARIANTS[name])
        assert trainer.accelerator.num_processes == 2
        replicas = trainer.accelerator.gather(delta[None])
        assert torch.equal(replicas[0], replicas[1]), f"{name}: parameters differ between processes"
        results[f"{name}/update"] = delta.contiguous()
        results[f"{name}/advantages"] = torch.tensor(list(trainer._logs["advantages"]))
        if name == "ctwa":
            results[f"{name}/log_weights"] = trainer._controller.log_weights.clone()
    if PartialState().is_main_process:
        save_file(results, os.path.join(out_dir, "grpo_updates.safetensors"))
    PartialState().wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()  # a hang dumps every stack and exits before the test's timeout
    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

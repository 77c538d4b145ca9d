"""Run under `accelerate launch --multi_gpu --num_processes 2`: two SGD steps of MAP and sine adapters under both
trainers with half the global batch per process. Rank 0 saves the updates; every rank checks the replicas agree."""

import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters"))
from adapter_cases import CASES, adapter_config
from grpo_helpers import G, grpo_run
from sft_helpers import GLOBAL_BATCH, one_step_update


# Two steps: MAP's A and B get no gradient on the first (β starts at 0), so one step would test only the scalars.
TWO_STEPS = dict(max_steps=2, learning_rate=0.1)
RUNS = {f"{trainer}_{kind}": (trainer, kind) for trainer in ("sft", "grpo") for kind in CASES}


def run(name, out_dir, processes):
    trainer_name, kind = RUNS[name]
    path = os.path.join(out_dir, name)
    if trainer_name == "sft":
        return one_step_update(path, GLOBAL_BATCH // processes, 1, peft_config=adapter_config(kind), **TWO_STEPS)
    return grpo_run(path, batch_size=2 * G // processes, peft_config=adapter_config(kind), **TWO_STEPS)


def main(out_dir, names):
    torch.set_num_threads(1)
    results = {}
    for name in names:
        delta, trainer = run(name, out_dir, processes=2)
        assert trainer.accelerator.num_processes == 2
        replicas = trainer.accelerator.gather(delta[None])
        assert torch.equal(replicas[0], replicas[1]), f"{name}: parameters differ between processes"
        results[name] = delta.contiguous()
    if PartialState().is_main_process:
        save_file(results, os.path.join(out_dir, "adapter_updates.safetensors"))
    PartialState().wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()  # a hang dumps every stack and exits before the test's timeout
    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

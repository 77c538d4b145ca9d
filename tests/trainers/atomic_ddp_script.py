"""Two ranks save checkpoints atomically: rank 1 writes its RNG file late (it sleeps first), so a rename that did not
wait for every rank would leave `rng_state_1.pth` in a recreated staging folder. Then a resume with True."""

import json
import os
import sys
import time

import torch


def make(output_dir, max_steps):
    from sft_helpers import STEP_ARGS

    from hf_stable import StableSFTConfig, StableSFTTrainer
    from hf_stable.testing import arithmetic_dataset, build_tiny_model

    model, tok = build_tiny_model(seed=0)
    base = {**STEP_ARGS, "per_device_train_batch_size": 2}
    base.update(max_steps=max_steps, optim="adamw_torch", learning_rate=5e-3, save_strategy="steps", save_steps=2)
    base.update(sample_reweighting="feasible", fl_epsilon=2.0)
    args = StableSFTConfig(output_dir=output_dir, **base)
    data = arithmetic_dataset(32, seed=3)
    trainer = StableSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    if trainer.args.process_index == 1:
        save_rng = trainer._save_rng_state

        def late_rng_state(output_dir):
            time.sleep(1.0)
            save_rng(output_dir)

        trainer._save_rng_state = late_rng_state
    return trainer


def main(out_dir):
    torch.set_num_threads(1)
    make(out_dir, 4).train()
    trainer = make(out_dir, 6)
    trainer.train(resume_from_checkpoint=True)
    if trainer.is_world_process_zero():
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step}, f)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()
    main(sys.argv[1])
    end_rank()

"""Run under `accelerate launch --multi_gpu --num_processes 2`: WSMCallback in 2-process CPU DDP.

Run "full": 8 steps with merged evaluation every 2 steps (the merged tensors are broadcast from rank 0), a merge at
each save and at the end. Run "split": the same, stopped at step 4 and resumed from checkpoint-4. Each rank writes
`rank{r}.json` (what it holds, its merged-eval metrics, whether evaluation restored its weights bit-exactly); rank 0
also writes the independently computed expected merge (`expected.safetensors`).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "callbacks"))
from wsm_helpers import Recorder, StopAt, make_trainer

from hf_stable.callbacks import WSMCallback
from hf_stable.merging.wsm import wsm_weights


SETTINGS = dict(schedule="1-sqrt", interval_steps=2, num_intervals=2, merge_at=("eval", "save", "end"), storage="cpu")
COMMON = dict(max_steps=8, save_strategy="steps", save_steps=4, eval_dataset=True, eval_strategy="steps", eval_steps=2)


def run(output_dir, stop=None, resume=None):
    recorder, cb = Recorder(), WSMCallback(**SETTINGS)
    callbacks = [recorder, cb] + ([StopAt(stop)] if stop else [])
    trainer = make_trainer(output_dir, callbacks, **COMMON)
    cb.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb, recorder


def main(out_dir):
    torch.set_num_threads(1)
    trainer, cb, recorder = run(os.path.join(out_dir, "full"))
    acc = trainer.accelerator
    assert acc.num_processes == 2, f"expected 2 processes, got {acc.num_processes}"
    rank = acc.process_index
    logged = [h["step"] for h in trainer.state.log_history if "eval_wsm_loss" in h]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.evaluate()
    restored = all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    # the merged evaluation must agree across ranks (same merged weights everywhere)
    losses = acc.gather(torch.tensor([metrics["eval_wsm_loss"]]))
    report = {
        "rank": rank,
        "holds_window": cb.holds_window,
        "stored": len(cb._store._ram),
        "prev": cb._prev is not None,
        "steps": cb.steps,
        "eval_wsm_loss": metrics["eval_wsm_loss"],
        "eval_wsm_losses_all_ranks": losses.tolist(),
        "restored": restored,
        "eval_wsm_logged": logged,
    }
    if rank == 0:
        _, c = wsm_weights(SETTINGS["schedule"], len(cb.steps) - 1)
        snaps = [recorder.snapshots[t] for t in cb.steps]
        save_file(
            {n: sum(cj * s[n] for cj, s in zip(c, snaps, strict=True)).float().contiguous() for n in snaps[0]},
            os.path.join(out_dir, "expected.safetensors"),
        )
    split = os.path.join(out_dir, "split")
    run(split, stop=4)
    _, cb2, _ = run(split, resume=os.path.join(split, "checkpoint-4"))
    report["resumed_steps"] = cb2.steps
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import arm_hang_dump, end_rank

    arm_hang_dump()  # a hang dumps every stack and exits before the test's timeout
    main(sys.argv[1])
    end_rank()

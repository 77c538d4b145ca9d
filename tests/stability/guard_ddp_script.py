"""Two-process gloo DDP: faults injected on rank 1 only; the guard must act on both ranks together.

Usage (via `accelerate launch --multi_gpu --num_processes 2`): guard_ddp_script.py MODEL_DIR OUT_DIR. Each rank writes
OUT_DIR/rank<r>.json with its decisions, counters and a parameter checksum. A hang dumps every thread's stack and exits
(faulthandler), so the launching test fails with the stack instead of waiting.
"""

import faulthandler
import json
import os
import sys


faulthandler.dump_traceback_later(240, exit=True)
sys.path.insert(0, os.path.dirname(__file__))

from guard_helpers import has_nan, sft_trainer  # noqa: E402


def main(model_dir, out_dir):
    trainer, guard, _ = sft_trainer(os.path.join(out_dir, "run"), 60, model_dir=model_dir,
                                    guard=dict(snapshot_every=10, confirm_steps=2),
                                    inject=dict(kind="corrupt_batch", steps=[40, 50, 51], ranks=[1]))
    from hf_stable.callbacks import FaultInjectionCallback

    nan = FaultInjectionCallback.attach(trainer, kind="nan_loss", steps=[56], ranks=[1])
    trainer.train()
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "world": trainer.args.world_size,
        "decisions": [[d.step, d.kind, d.action, d.restore_step] for d in guard.decisions],
        "state": guard.policy.state(),
        "checksum": sum(float(p.detach().double().sum()) for p in trainer.model.parameters()),
        "has_nan": has_nan(trainer.model),
        "nan_injected": nan.injected,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch_helpers import end_rank

    main(sys.argv[1], sys.argv[2])
    end_rank()

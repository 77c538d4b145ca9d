"""Run under `accelerate launch --multi_gpu --num_processes 2`: every row of the distributed matrix in one launch
(the imports cost more than the runs). Rank 0 saves `matrix_updates.safetensors` (per row, the update and the state
that must agree) and `matrix_refusals.json` (per refused row, the message). Every rank checks that the replicas agree.

A hang dumps every thread's stack and exits (faulthandler), so the launching test fails with the stack.
"""

import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import arm_hang_dump, end_rank


arm_hang_dump()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from matrix_rows import BY_NAME, MAIN_PROCESS_ONLY, run  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def main(out_dir, names):
    torch.set_num_threads(1)
    results, refusals = {}, {}
    for name in names:
        if BY_NAME[name].ddp_refusal is not None:
            try:
                run(name, out_dir, processes=2)
            except ValueError as err:
                refusals[name] = str(err)
            else:
                refusals[name] = None
            continue
        if BY_NAME[name].detects is not None:
            try:
                run(name, out_dir, processes=2)
            except Exception as err:  # the detector's own error type is checked by the test
                refusals[name] = f"{type(err).__name__}: {err}"
            from accelerate.utils import gather

            raised = gather(torch.tensor([float(name in refusals)]))
            refusals[f"{name}/processes_raised"] = int(raised.sum())
            continue
        out = run(name, out_dir, processes=2)
        state = PartialState()
        assert state.num_processes == 2, f"expected 2 processes, got {state.num_processes}"
        if name not in MAIN_PROCESS_ONLY:
            from accelerate.utils import gather

            replicas = gather(out["update"][None])
            assert torch.equal(replicas[0], replicas[1]), f"{name}: parameters differ between processes"
            for key in BY_NAME[name].rank_local:
                replicas = gather(out[key][None])
                assert torch.equal(replicas[0], replicas[1]), f"{name}: {key} differs between processes"
        for key, value in out.items():
            results[f"{name}/{key}"] = value.contiguous()
    state = PartialState()
    if state.is_main_process:
        save_file(results, os.path.join(out_dir, "matrix_updates.safetensors"))
        with open(os.path.join(out_dir, "matrix_refusals.json"), "w") as f:
            json.dump(refusals, f)
    state.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
    end_rank()

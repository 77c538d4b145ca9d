"""DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on one machine's GPUs, through the shipped accelerate configs: every row of the
distributed matrix (tests/distributed/matrix_rows.py) that is not refused under the backend gives the update of one
plain process on the same global batch (fp32, so the comparison is tight).

Processes: 2 when the machine has 2 GPUs, else 1 (NCCL refuses two ranks on one device; one process still runs the
backend's sharding, gathering and checkpoint paths). The refusals themselves are tested on the CPU by
tests/distributed/test_matrix.py::test_other_backends.
"""

import os
import sys

import pytest
import torch
from gpu_helpers import GPU, HERE, close_updates


pytestmark = GPU
SCRIPT = os.path.join(HERE, "gpu_backend_script.py")
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "hf_stable", "accelerate_configs")
BACKENDS = ["zero2", "zero3", "fsdp2"]
# Refused on the CPU side (test_matrix.test_other_backends): these rows are not run under the backend.
REFUSED = {"zero3": ("Unlearning",), "fsdp2": ("Unlearning",)}
# the guard's default action rolls back from snapshots: refused under DeepSpeed (without disk snapshots) and FSDP
REFUSED_ROWS = {"zero2": ("stableun", "stability_guard"), "zero3": ("stability_guard",), "fsdp2": ("stability_guard",)}


def _rows(family, backend):
    from matrix_rows import ROWS

    if family in REFUSED.get(backend, ()):
        pytest.skip(f"{family} is refused under {backend} (tested on the CPU)")
    rows = [r.name for r in ROWS if r.family == family and r.ddp_refusal is None]
    if family == "SFT objective" and backend.startswith("zero"):
        # threshold_normalization='active' is refused under DeepSpeed (tested on the CPU); 'supervised' runs
        rows = [n for n in rows if "threshold_supervised" in n or ("threshold" not in n and n != "bottom_logp")]
    return [n for n in rows if n not in REFUSED_ROWS[backend]]


def _launch(backend, rows, out, port):
    from launch_helpers import run_with_stacks

    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    processes = min(2, torch.cuda.device_count())
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, f"{backend}.yaml"),
        "--num_processes",
        str(processes),
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(port),
        SCRIPT,
        str(out),
        ",".join(rows),
    ]
    run_with_stacks(cmd, timeout=480)
    from safetensors.torch import load_file

    return load_file(str(out / "backend_updates.safetensors"))


def _check(family, backend, tmp_path, port):
    from matrix_rows import run

    rows = _rows(family, backend)
    got = _launch(backend, rows, tmp_path / "launch", port)
    for name in rows:
        single = run(name, str(tmp_path / "single"), processes=1, overrides={"use_cpu": False})
        close_updates(got[name], single["update"], rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sft_under_backend(backend, tmp_path):
    _check("SFT objective", backend, tmp_path, 29900 + BACKENDS.index(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_under_backend(backend, tmp_path):
    _check("GRPO", backend, tmp_path, 29910 + BACKENDS.index(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unlearn_under_backend(backend, tmp_path):
    _check("Unlearning", backend, tmp_path, 29920 + BACKENDS.index(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_under_backend(backend, tmp_path):
    _check("Adapters", backend, tmp_path, 29930 + BACKENDS.index(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_callbacks_under_backend(backend, tmp_path):
    _check("Callback", backend, tmp_path, 29940 + BACKENDS.index(backend))

#!/usr/bin/env bash
# Run the GPU suite (tests/gpu, marker `gpu`) on a CUDA machine and write a small JSON report.
#
#   scripts/gpu_check.sh [REPORT.json]        # default: gpu_report.json; PYTHON=... picks the interpreter
#
# Budget: 10 minutes on one GPU (pytest gets 570 s, each multi-process launch 480 s; a hung launch fails with every
# process's stack). Without CUDA every test is skipped and the report says so. Optional packages (deepspeed, vllm,
# bitsandbytes) that are missing skip their tests; the report lists the versions found.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${1:-gpu_report.json}"
PYTHON="${PYTHON:-python}"
XML="$(mktemp --suffix=.xml)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_STABLE_LAUNCH_TIMEOUT=480 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
timeout --signal=INT --kill-after=20 570 "$PYTHON" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rs \
    --junitxml="$XML" -o junit_family=xunit2
status=$?
"$PYTHON" - "$XML" "$REPORT" "$status" "$(( $(date +%s) - start ))" <<'PY'
import importlib.metadata as md
import json
import os
import sys
import xml.etree.ElementTree as ET

import torch

xml, report, status, wall = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


tests, summary = [], {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
if os.path.getsize(xml) if os.path.exists(xml) else 0:
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, (node.get("message") or "")[:500]
                break
        summary[outcome] += 1
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "message": message})
cuda = torch.cuda.is_available()
result = {
    "exit_status": status,
    "timed_out": status in (124, 137),
    "wall_seconds": wall,
    "device": torch.cuda.get_device_name(0) if cuda else None,
    "device_count": torch.cuda.device_count() if cuda else 0,
    "versions": {name: version(name) for name in
                 ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "vllm", "bitsandbytes")},
    "cuda": torch.version.cuda,
    "summary": summary,
    "tests": tests,
}
with open(report, "w") as f:
    json.dump(result, f, indent=2)
print(f"{report}: {summary} in {wall} s (exit {status})")
PY
rm -f "$XML"
exit "$status"

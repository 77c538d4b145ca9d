"""Without CUDA, `pytest -m gpu` collects the whole GPU suite and skips every test cleanly (no error, no failure)."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite runs (scripts/gpu_check.sh)")
def test_gpu_suite_skips_cleanly_without_cuda(tmp_path):
    junit = tmp_path / "gpu.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "skipped", "failures", "errors")}
    assert counts["tests"] >= 20 and counts["skipped"] == counts["tests"], counts
    assert counts["failures"] == counts["errors"] == 0, counts
    reasons = {case.find("skipped").get("message") for case in suite.iter("testcase")}
    assert all("CUDA" in r for r in reasons), reasons

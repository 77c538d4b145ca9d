"""The SmolLM2 examples run end to end at 1–2 steps and print their before/after numbers."""

import os
import re
import sys

import pytest
from launch_helpers import run_with_stacks


pytestmark = pytest.mark.slow
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
NUMBER = r"-?\d+\.\d{4}"
CASES = {
    "sft_smollm2_lora.py": (["--steps", "2"], [rf"before +{NUMBER} +{NUMBER}", rf"after +{NUMBER} +{NUMBER}"]),
    "grpo_smollm2_qlora.py": (
        ["--steps", "1"],
        [rf"first step +{NUMBER} +{NUMBER}", rf"last step +{NUMBER}", rf"before +{NUMBER}", rf"after +{NUMBER}"],
    ),
    "unlearn_smollm2.py": (
        ["--steps", "1", "--teach_steps", "2"],
        [
            rf"base model +{NUMBER}( +{NUMBER}){{2}}",
            rf"after teaching( +{NUMBER}){{3}}",
            rf"after unlearning( +{NUMBER}){{3}}",
        ],
    ),
    "merge_smollm2.py": (
        ["--steps", "1"],
        [rf"merged ties +{NUMBER} +{NUMBER}", rf"merged fisher_rao +{NUMBER} +{NUMBER}", r"merged ties: '.+' -> '.*'"],
    ),
    "map_adapters_smollm2.py": (
        ["--steps", "2"],
        [
            rf"before +{NUMBER}",
            rf"after +{NUMBER}",
            r"load_adapter +0\.0000",
            r"PeftModel.from_pretrained +0\.0000",
            "reloaded exactly",
            r"adapted layers are hf_stable\.adapters",
        ],
    ),
}


@pytest.mark.parametrize("script", sorted(CASES), ids=lambda name: name.removesuffix(".py"))
def test_example_runs(smollm2_dir, tmp_path, script):
    args, patterns = CASES[script]
    cache = os.path.dirname(smollm2_dir)  # the examples look for <cache>/smollm2-135m-instruct
    cmd = [
        sys.executable,
        os.path.join(EXAMPLES, script),
        *args,
        "--cache_dir",
        cache,
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    result = run_with_stacks(cmd, timeout=1500, env=env)
    for pattern in patterns:
        assert re.search(pattern, result.stdout), f"{script}: no line matching {pattern!r} in\n{result.stdout[-3000:]}"

"""The SmolLM2 examples run end to end at 1–2 steps and print their before/after numbers."""

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

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


def _run(script, smollm2_dir, out):
    args, _ = CASES[script]
    cache = os.path.dirname(smollm2_dir)  # the examples look for <cache>/smollm2-135m-instruct
    cmd = [sys.executable, os.path.join(EXAMPLES, script), *args, "--cache_dir", cache, "--output_dir", str(out)]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return run_with_stacks(cmd, timeout=1500, env=env)


@pytest.fixture(scope="module")
def example_runs(request, smollm2_dir, tmp_path_factory):
    """The selected examples' runs, two at a time (each is one single-threaded process and CI has two cores, so this
    about halves the module's wall time): script -> its CompletedProcess, or what its run raised (a failure or a
    hang), re-raised by that script's test alone."""
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if item.originalname == "test_example_runs" and hasattr(item, "callspec")
    ]

    def run(script):
        try:
            return script, _run(script, smollm2_dir, tmp_path_factory.mktemp(script.removesuffix(".py")) / "out")
        except BaseException as err:  # pytest's Failed included: it belongs to that test
            return script, err

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, selected))


@pytest.mark.parametrize("script", sorted(CASES), ids=lambda name: name.removesuffix(".py"))
def test_example_runs(example_runs, script):
    result = example_runs[script]
    if isinstance(result, BaseException):
        raise result
    for pattern in CASES[script][1]:
        assert re.search(pattern, result.stdout), f"{script}: no line matching {pattern!r} in\n{result.stdout[-3000:]}"

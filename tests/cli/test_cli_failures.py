"""`hf-stable sft|grpo` failures: one stderr line naming the culprit, a non-zero exit, no traceback, nothing written.

Budget: every process that imports TRL costs about 9 s of CPU. The cases found before the launch therefore run the
real `hf_stable.cli.main.main` one after another in a single child process (`_DRIVER`: each case with its own
stderr file descriptor, so whatever a library writes there is seen); one case (a mistyped flag) runs the
`hf-stable` console script itself. Three cases need launched ranks: a setting only the trainer refuses, with one
process and with two (the line is printed once, not per rank), and Ctrl-C during GRPO followed by
`--resume_from_checkpoint true`, as the interruption message says.

Progress bars are switched off (`HF_HUB_DISABLE_PROGRESS_BARS`, `disable_tqdm`): with them, stderr also carries
transformers' weight-loading and the trainer's step bars.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hf_stable.testing import arithmetic_dataset


QUIET = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}

SFT = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
max_steps: 2
per_device_train_batch_size: 4
learning_rate: 0.01
max_length: 32
save_strategy: "no"
report_to: none
gradient_checkpointing: false
use_cpu: true
bf16: false
disable_tqdm: true
"""

GRPO = """\
model_name_or_path: {model}
synthetic_dataset: arithmetic
synthetic_train_size: 64
reward_funcs: [arithmetic_exact_match]
output_dir: {out}
num_generations: 4
per_device_train_batch_size: 4
max_completion_length: 4
max_steps: 1000
learning_rate: 0.01
save_strategy: steps
save_steps: 1
report_to: none
gradient_checkpointing: false
use_cpu: true
bf16: false
disable_tqdm: true
"""


def _console_script():
    return os.path.join(os.path.dirname(sys.executable), "hf-stable")


def _env():
    env = {**os.environ, **QUIET}
    env.pop("HF_STABLE_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model_dir):
    w = tmp_path_factory.mktemp("cli-failures")
    with open(w / "train.jsonl", "w") as f:
        for row in arithmetic_dataset(16, seed=2):
            f.write(json.dumps(row) + "\n")
    (w / "no_column.jsonl").write_text('{"question": "1+1=", "reply": "2"}\n')
    (w / "empty.jsonl").write_text("")
    (w / "a_file").write_text("not a folder")
    bad = w / "corrupt-model"
    shutil.copytree(tiny_model_dir, bad)
    weights = bad / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)  # a download cut short
    (w / "sft.yaml").write_text(SFT.format(model=tiny_model_dir, data=w / "train.jsonl", out=w / "out"))
    (w / "typo.yaml").write_text((w / "sft.yaml").read_text().replace("learning_rate", "lerning_rate"))
    (w / "grpo.yaml").write_text(GRPO.format(model=tiny_model_dir, out=w / "grpo-out"))
    return w


def _skip_reason(case: str) -> str | None:
    import importlib.util

    if case == "output_dir_read_only" and os.geteuid() == 0:
        return "root writes into a read-only folder"
    if case == "liger" and importlib.util.find_spec("liger_kernel") is not None:
        return "liger-kernel is installed here"
    return None


# id -> (command, its flags after `--config <the work folder's command>.yaml`, what the line must name). `{w}` is
# the work folder; every case writes to its own output folder `{w}/out-<id>` unless it names another.
PRE_LAUNCH = {
    "missing_model": ("sft", ["--model_name_or_path", "{w}/no-such-model"], "no-such-model"),
    "uncached_hub_id": ("sft", ["--model_name_or_path", "tiny-modle"], "tiny-modle"),
    "corrupt_safetensors": ("sft", ["--model_name_or_path", "{w}/corrupt-model"], "corrupt-model/model.safetensors"),
    "output_dir_is_a_file": ("sft", ["--output_dir", "{w}/a_file"], "a_file"),
    "output_dir_read_only": ("sft", ["--output_dir", "{w}/read_only/out"], "read_only"),
    "empty_dataset": ("sft", ["--dataset_name", "{w}/empty.jsonl"], "empty.jsonl"),
    "dataset_without_column": ("sft", ["--dataset_name", "{w}/no_column.jsonl"], "no_column.jsonl"),
    "liger": ("sft", ["--use_liger_kernel", "true"], "use_liger_kernel"),
    "padding_free": ("sft", ["--padding_free", "true"], "padding_free"),
    "assistant_only_loss": ("sft", ["--assistant_only_loss", "true"], "assistant_only_loss"),
    "batch_size_0": ("sft", ["--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
    "map_with_dora": (
        "sft",
        ["--use_peft", "--lora_variant", "map", "--use_dora", "--lora_target_modules", "q_proj"],
        "use_dora",
    ),
    "unknown_reward": ("grpo", ["--reward_funcs", "no_such_reward"], "no_such_reward"),
    "resume_true_without_checkpoint": ("sft", ["--resume_from_checkpoint", "true"], "resume_from_checkpoint"),
    "unknown_yaml_field": ("typo", [], "`lerning_rate` in"),
}

_DRIVER = """
import json, os, sys, traceback
from hf_stable.cli.main import main

results = {}
for case, argv in json.loads(sys.argv[1]).items():
    path = os.path.join(sys.argv[2], case + ".err")
    saved = os.dup(2)
    with open(path, "w") as err:
        os.dup2(err.fileno(), 2)  # the file descriptor: what C code and child processes write is caught too
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except Exception:  # reported as the case's own failure, with its traceback
            traceback.print_exc()
            code = None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
    results[case] = {"code": code, "stderr": open(path).read()}
print(json.dumps(results))
"""


def _selected_cases(request) -> list[str]:
    """The PRE_LAUNCH ids of the tests this session runs (so `-k` runs only those through the driver)."""
    # only this module's items: other test files parametrize a `case` of their own
    ids = [getattr(item, "callspec", None) for item in request.session.items if item.module is request.module]
    cases = {spec.params["case"] for spec in ids if spec is not None and "case" in spec.params}
    return sorted(case for case in cases if not _skip_reason(case))


@pytest.fixture(scope="module")
def pre_launch_results(request, work):
    cases = {}
    for case in _selected_cases(request):
        config, flags, _ = PRE_LAUNCH[case]
        command = "grpo" if config == "grpo" else "sft"
        argv = [command, "--config", str(work / f"{config}.yaml"), *(a.format(w=work) for a in flags)]
        if not any(a == "--output_dir" for a in argv):
            argv += ["--output_dir", str(work / f"out-{case}")]
        cases[case] = argv
    read_only = work / "read_only"
    read_only.mkdir(exist_ok=True)
    read_only.chmod(0o555)
    try:
        result = subprocess.run(
            [sys.executable, "-c", _DRIVER, json.dumps(cases), str(work)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=600,
        )
    finally:
        read_only.chmod(0o755)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    return lines[0]


@pytest.mark.parametrize("case", sorted(PRE_LAUNCH))
def test_refused_before_launch_in_one_line(case, work, pre_launch_results):
    if _skip_reason(case):
        pytest.skip(_skip_reason(case))
    result = pre_launch_results[case]
    line = _one_line(result["stderr"])
    assert result["code"] == 2
    assert line.startswith("hf-stable ") and ": error: " in line
    assert PRE_LAUNCH[case][2] in line, line
    assert "connect" not in line  # a missing local path is named as such, not as a Hub connection problem
    assert not (work / f"out-{case}").exists()  # nothing was launched, nothing written
    assert (work / "a_file").read_text() == "not a folder"
    assert not (work / "read_only" / "out").exists()


def test_unknown_flag_names_the_closest_one(work):
    """The console script itself: `--lerning_rate` is reported by hf-stable, not by accelerate's parser."""
    out = work / "out-typo"
    result = subprocess.run(
        [_console_script(), "sft", "--config", str(work / "sft.yaml"), "--output_dir", str(out), "--lerning_rate",
         "1e-3"],
        capture_output=True, text=True, env=_env(), timeout=600,
    )  # fmt: skip
    line = _one_line(result.stderr)
    assert result.returncode == 2
    assert "unknown flag --lerning_rate" in line and "did you mean --learning_rate?" in line
    assert "usage:" not in result.stderr and not out.exists()


def _in_rank_failure(work, out, *launcher):
    # REDI needs 'chosen'/'rejected' columns; the data has prompt/completion. Only the trainer, in the rank, says so.
    return subprocess.run(
        [_console_script(), "sft", "--config", str(work / "sft.yaml"), "--output_dir", str(out),
         "--sft_objective", "nll", "--sequence_objective", "redi", *launcher],
        capture_output=True, text=True, env=_env(), timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_a_rank_refusal_is_one_line(work):
    out = work / "out-rank"
    result = _in_rank_failure(work, out)
    line = _one_line(result.stderr)
    assert result.returncode == 1
    assert line.startswith("hf-stable sft: error: sequence_objective='redi' needs") and "chosen" in line
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_refusal_on_two_ranks_is_printed_once(work):
    out = work / "out-ddp"
    result = _in_rank_failure(work, out, "--accelerate_config", "ddp", "--main_process_port", "29657")
    line = _one_line(result.stderr)
    assert result.returncode == 1
    assert line.startswith("hf-stable sft: error: sequence_objective='redi' needs")
    assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_during_grpo_then_resume_true(work):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once a checkpoint exists: one line naming
    it, status 130. Then `--resume_from_checkpoint true` continues from it (before: the string "true" was a path)."""
    out = work / "grpo-out"
    command = [_console_script(), "grpo", "--config", str(work / "grpo.yaml")]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group: the launcher and its rank, like a terminal's foreground
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not the ignored SIGINT of a background job
    )
    try:
        deadline = time.time() + 600
        while not (out / "checkpoint-2" / "trainer_state.json").is_file():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = _one_line(stderr)
    assert proc.returncode == 130
    assert line.startswith("hf-stable grpo: interrupted; the last checkpoint is ")
    checkpoint = line.split("the last checkpoint is ", 1)[1].split(" ", 1)[0]
    assert os.path.dirname(checkpoint) == str(out) and os.path.isfile(os.path.join(checkpoint, "trainer_state.json"))
    step = int(checkpoint.rsplit("-", 1)[1])
    assert step >= 2 and "--resume_from_checkpoint true" in line

    first = os.path.getmtime(out / "checkpoint-1" / "trainer_state.json")
    result = subprocess.run(
        [*command, "--resume_from_checkpoint", "true", "--max_steps", str(step + 1)],
        capture_output=True, text=True, env=_env(), timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((out / f"checkpoint-{step + 1}" / "trainer_state.json").read_text())
    assert state["global_step"] == step + 1
    # one step was trained, from the checkpoint: the earlier checkpoints were not written again
    assert os.path.getmtime(out / "checkpoint-1" / "trainer_state.json") == first


@pytest.mark.slow
def test_full_disk_at_the_final_save_is_one_line_and_leaves_nothing(work):
    """The disk fills while `hf-stable sft` saves the trained model: a file-size limit (`RLIMIT_FSIZE`, with SIGXFSZ
    ignored so that the write fails with EFBIG instead of killing the process) below the weights' size (about 320 kB)
    and above everything the run writes before. Before atomic saves this printed tracebacks and left `config.json`
    without weights in the output folder."""
    import resource

    out = work / "out-full-disk"

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    result = subprocess.run(
        [_console_script(), "sft", "--config", str(work / "sft.yaml"), "--output_dir", str(out)],
        capture_output=True, text=True, env=_env(), timeout=900, preexec_fn=small_disk,
    )  # fmt: skip
    line = _one_line(result.stderr)
    assert result.returncode == 1
    assert "could not save to" in line and str(out) in line and "File too large" in line
    assert not any(p.name in ("config.json", "model.safetensors") for p in out.rglob("*")) if out.exists() else True

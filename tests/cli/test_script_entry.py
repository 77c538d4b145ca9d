"""`hf_stable.scripts.entry.run_script`, the end of every launched training script, on a stub script (no TRL import,
so each case is a sub-second child process), and the launcher's side: unknown flags, the ranks' error files."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hf_stable.scripts.entry import ERROR_DIR_ENV, interrupted_message, last_checkpoint, resume_argument


STUB = """
import atexit, sys
from types import SimpleNamespace
from hf_stable.scripts.entry import run_script

kind, output_dir = sys.argv[1], sys.argv[2]


class Parser:
    def parse_args_and_config(self, fail_with_unknown_args=False):
        return SimpleNamespace(), SimpleNamespace(output_dir=output_dir)


def main(script_args, training_args):
    if kind == "value":
        raise ValueError("`alpha`=-2 is not valid.\\n   Allowed: alpha > 0.")
    if kind == "disk":
        raise OSError(28, "No space left on device", output_dir + "/checkpoint-3")
    if kind == "bug":
        raise KeyError("not an expected error")
    if kind == "interrupt":
        raise KeyboardInterrupt


atexit.register(lambda: print("finalized", flush=True))
run_script("sft", Parser, main)
"""


def _run(kind, tmp_path, **env):
    full = {**os.environ, **env}
    for name in ("HF_STABLE_DEBUG", ERROR_DIR_ENV, "WORLD_SIZE", "RANK"):
        if name not in env:
            full.pop(name, None)
    command = [sys.executable, "-c", STUB, kind, str(tmp_path / "out")]
    return subprocess.run(command, capture_output=True, text=True, env=full, timeout=120)


def test_an_expected_error_is_one_line(tmp_path):
    result = _run("value", tmp_path)
    assert result.returncode == 1
    assert result.stderr == "hf-stable sft: error: `alpha`=-2 is not valid. Allowed: alpha > 0.\n"
    result = _run("disk", tmp_path)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert f"{tmp_path}/out/checkpoint-3" in result.stderr and "No space left on device" in result.stderr


def test_an_unexpected_error_keeps_its_traceback(tmp_path):
    result = _run("bug", tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "KeyError: 'not an expected error'" in result.stderr


def test_debug_shows_the_traceback(tmp_path):
    result = _run("value", tmp_path, HF_STABLE_DEBUG="1")
    assert result.returncode == 1 and "Traceback" in result.stderr and "ValueError" in result.stderr


def test_under_the_launcher_the_line_goes_to_the_error_folder(tmp_path):
    folder = tmp_path / "errors"
    folder.mkdir()
    result = _run("value", tmp_path, **{ERROR_DIR_ENV: str(folder), "RANK": "1"})
    assert result.returncode == 1 and result.stderr == ""
    assert (folder / "rank-1").read_text() == "hf-stable sft: error: `alpha`=-2 is not valid. Allowed: alpha > 0.\n"


def test_other_ranks_exit_quietly_and_without_finalization(tmp_path):
    result = _run("value", tmp_path, WORLD_SIZE="2", RANK="1")
    assert result.returncode == 1 and result.stderr == "" and "finalized" not in result.stdout
    result = _run("value", tmp_path, WORLD_SIZE="2", RANK="0")
    assert result.returncode == 1 and result.stderr.startswith("hf-stable sft: error: `alpha`")
    assert "finalized" not in result.stdout  # os._exit: no interpreter finalization with gloo threads alive
    result = _run("value", tmp_path)  # one process: a normal exit
    assert "finalized" in result.stdout


def test_interrupt_is_one_line_naming_the_last_complete_checkpoint(tmp_path):
    result = _run("interrupt", tmp_path)
    assert result.returncode == 130 and result.stderr == "hf-stable sft: interrupted; no checkpoint was saved\n"
    for step, complete in ((3, True), (12, True), (20, False)):  # checkpoint-20: its save was cut short
        folder = tmp_path / "out" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    result = _run("interrupt", tmp_path)
    expected = f"{tmp_path}/out/checkpoint-12"
    assert result.returncode == 130 and "Traceback" not in result.stderr
    assert result.stderr == f"{interrupted_message('sft', str(tmp_path / 'out'))}\n"
    assert f"the last checkpoint is {expected} (continue with --resume_from_checkpoint true)" in result.stderr
    assert last_checkpoint(str(tmp_path / "out")) == expected
    # under hf-stable the launcher prints the interruption: the rank says nothing
    folder = tmp_path / "errors"
    folder.mkdir()
    result = _run("interrupt", tmp_path, **{ERROR_DIR_ENV: str(folder)})
    assert result.returncode == 130 and result.stderr == "" and os.listdir(folder) == []


def test_ctrl_c_while_the_libraries_load_is_quiet(tmp_path):
    program = (
        "from hf_stable.scripts.entry import quiet_interrupts\nquiet_interrupts()\nimport time\nprint('ready', "
        "flush=True)\ntime.sleep(60)\n"
    )
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=restore
    )
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == ""


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("True", True), ("YES", True), ("1", True), (True, True), ("false", None), ("no", None),
     ("0", None), (None, None), (False, None), ("out/checkpoint-4", "out/checkpoint-4")],
)  # fmt: skip
def test_resume_argument(value, expected):
    assert resume_argument(value) == expected


def test_unknown_flags_and_fields_name_the_closest_one():
    from hf_stable.cli.launch import check_launcher_args
    from hf_stable.scripts.sft import make_parser

    parser = make_parser(prog="hf-stable sft")
    check_launcher_args(parser, ["--num_processes", "2"], ["--main_process_port", "29500", "--multi_gpu"], "c.yaml")
    check_launcher_args(parser, [], ["--main_process_port=29500", "--accelerate_config", "ddp"], None)
    with pytest.raises(ValueError, match=r"^unknown flag --lerning_rate; did you mean --learning_rate\?$"):
        check_launcher_args(parser, [], ["--lerning_rate", "1e-3"], None)
    with pytest.raises(ValueError, match=r"^unknown field `sft_objectiv` in c.yaml; did you mean `sft_objective`\?$"):
        check_launcher_args(parser, ["--sft_objectiv", "nll"], [], "c.yaml")
    with pytest.raises(ValueError, match="`hf-stable sft --help` lists every flag"):
        check_launcher_args(parser, [], ["--zzzzzzzz"], None)
    with pytest.raises(ValueError, match=r"unexpected argument 'c\.yaml'"):
        check_launcher_args(parser, [], ["c.yaml"], None)


def test_the_launcher_prints_each_distinct_rank_error_once(tmp_path):
    from hf_stable.cli.launch import _error_lines

    for rank, error in ((0, "A"), (1, "A"), (10, "B")):
        (tmp_path / f"rank-{rank}").write_text(f"hf-stable sft: error: {error}\n")
    (tmp_path / "rank-2.tmp").write_text("half")
    assert _error_lines(str(tmp_path)) == ["hf-stable sft: error: A", "hf-stable sft: error: B"]

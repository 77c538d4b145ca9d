"""Atomic checkpoints and model saves: a process killed inside any phase of a save resumes from the newest complete
checkpoint and ends bitwise equal to an uninterrupted run; a full disk raises an `OSError` naming the folder and leaves
nothing half-written under a final name; ``resume_from_checkpoint=True`` passes over incomplete folders, saying why."""

import errno
import json
import logging
import os
import resource
import signal
import traceback

import pytest
import torch
from safetensors.torch import load_file, save_file
from sft_helpers import STEP_ARGS
from transformers import TrainerCallback

from hf_stable import StableSFTConfig, StableSFTTrainer
from hf_stable.testing import arithmetic_dataset, build_tiny_model


MAX_STEPS, SAVE_STEPS, KILLED = 6, 2, "checkpoint-4"


def make(output_dir, eval_dataset=None, **overrides):
    """Feasible Learning keeps per-sample multipliers in hf_stable's checkpointed state: a resume that lost them, or
    the optimizer, the scheduler or the RNG, would not end bitwise equal."""
    model, tokenizer = build_tiny_model(seed=0)
    base = {**STEP_ARGS, "per_device_train_batch_size": 4}
    base.update(
        max_steps=MAX_STEPS,
        optim="adamw_torch",
        learning_rate=5e-3,
        lr_scheduler_type="linear",
        sample_reweighting="feasible",
        fl_epsilon=2.0,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
    )
    base.update(overrides)
    args = StableSFTConfig(output_dir=str(output_dir), **base)
    return StableSFTTrainer(
        model=model,
        args=args,
        train_dataset=arithmetic_dataset(32, seed=3),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


def _state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer._multipliers.clone()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = make(tmp_path_factory.mktemp("full"))
    trainer.train()
    return _state(trainer)


def _kill(path=None):
    if path is not None:  # a file cut off mid-write, under the name it was being written to
        os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(phase):
    """Monkeypatch the child so it dies inside ``phase`` of the save of `KILLED`."""
    import transformers.modeling_utils as modeling_utils
    from transformers.trainer_callback import TrainerState

    import hf_stable.trainers._base as base

    if phase == "weights":
        original = modeling_utils.safe_save_file

        def save_weights(tensors, filename, *args, **kwargs):
            original(tensors, filename, *args, **kwargs)
            if KILLED in filename:
                _kill(filename)

        modeling_utils.safe_save_file = save_weights
    elif phase == "optimizer":
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            original_save(obj, f, *args, **kwargs)
            if isinstance(f, str) and KILLED in f and f.endswith("optimizer.pt"):
                _kill(f)

        torch.save = save
    elif phase == "trainer_state":
        original_json = TrainerState.save_to_json

        def save_to_json(self, json_path):
            original_json(self, json_path)
            if KILLED in json_path:
                _kill(json_path)

        TrainerState.save_to_json = save_to_json
    elif phase == "hf_stable_state":  # its tensors are written, its JSON is not
        original_write = base.write_json_atomic

        def write_json(path, payload):
            if KILLED in path:
                _kill()
            original_write(path, payload)

        base.write_json_atomic = write_json
    elif phase == "before_rename":  # everything written, not yet renamed
        original_publish = getattr(base, "publish_folder", None)

        def publish(staged, final):
            if final.endswith(KILLED):
                _kill()
            original_publish(staged, final)

        base.publish_folder = publish
    elif phase == "after_rename":  # renamed, not yet rotated
        original_rotate = getattr(base, "rotate_checkpoints", None)

        def rotate(**kwargs):
            if os.path.isdir(os.path.join(kwargs["output_dir"], KILLED)):
                _kill()
            original_rotate(**kwargs)

        base.rotate_checkpoints = rotate


def _killed_run(output_dir, phase):
    pid = os.fork()
    if pid == 0:  # the child: train until the armed phase kills it
        code = 3
        try:
            _arm(phase)
            make(output_dir).train()
        except BaseException:
            traceback.print_exc()
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the child was not killed ({status})"


PHASES = {  # phase -> the checkpoint a resume starts from
    "weights": "checkpoint-2",
    "optimizer": "checkpoint-2",
    "trainer_state": "checkpoint-2",
    "hf_stable_state": "checkpoint-2",
    "before_rename": "checkpoint-2",
    "after_rename": "checkpoint-4",
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_kill_inside_a_save_resumes_bitwise(tmp_path, phase, uninterrupted, caplog):
    """SIGKILL inside each phase of the save of checkpoint-4: no incomplete checkpoint-4 is left under its name, and
    ``resume_from_checkpoint=True`` resumes from the newest complete checkpoint and ends bitwise equal to a run that
    was never interrupted (weights and hf_stable's multipliers)."""
    _killed_run(tmp_path, phase)
    left = set(os.listdir(tmp_path))
    caplog.set_level(logging.INFO, logger="hf_stable.trainers._base")
    resumed = make(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    if PHASES[phase] == "checkpoint-2":
        assert KILLED not in left and f"tmp-{KILLED}" in left
    assert f"resumes from {tmp_path / PHASES[phase]}." in caplog.text
    if PHASES[phase] == "checkpoint-2":
        assert f"skips {tmp_path / f'tmp-{KILLED}'}: an unfinished save" in caplog.text
    weights, multipliers = _state(resumed)
    expected_weights, expected_multipliers = uninterrupted
    assert weights.keys() == expected_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, expected_weights[name]), name
    assert torch.equal(multipliers, expected_multipliers)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("tmp-")]


# ---------------------------------------------------------------------------------------------------------------------
# which checkpoint `resume_from_checkpoint=True` takes


def _checkpoint(folder, weights=True, trainer_state="{}", extra=()):
    os.makedirs(folder)
    if weights:
        save_file({"w": torch.ones(2)}, os.path.join(folder, "model.safetensors"))
    if trainer_state is not None:
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write(trainer_state)
    for name in extra:
        with open(os.path.join(folder, name), "w") as f:
            f.write("{}")


def test_newest_complete_checkpoint_and_the_reasons_for_the_others(tmp_path):
    from hf_stable.trainers._atomic import last_complete_checkpoint

    _checkpoint(tmp_path / "checkpoint-2")
    _checkpoint(tmp_path / "checkpoint-10", weights=False, trainer_state=None, extra=("config.json",))  # an old save
    _checkpoint(tmp_path / "checkpoint-3", trainer_state=None)
    _checkpoint(tmp_path / "checkpoint-4", trainer_state='{"global_st')
    _checkpoint(tmp_path / "tmp-checkpoint-12")
    _checkpoint(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-20").write_text("a file, not a folder")
    found, skipped = last_complete_checkpoint(str(tmp_path))
    assert found == str(tmp_path / "checkpoint-2")
    reasons = dict(skipped)
    assert list(reasons) == ["tmp-checkpoint-12", "checkpoint-10", "checkpoint-4", "checkpoint-3"]
    assert reasons["checkpoint-10"] == "no model weights"
    assert reasons["checkpoint-3"] == "no trainer_state.json"
    assert reasons["checkpoint-4"].startswith("unreadable trainer_state.json")
    assert reasons["tmp-checkpoint-12"].startswith("an unfinished save")


def test_sharded_checkpoints_count_as_weights(tmp_path):
    """DeepSpeed without gathered weights writes `global_stepN/`, FSDP's sharded state `pytorch_model_fsdp_0/`."""
    from hf_stable.trainers._atomic import checkpoint_problem

    for shard in ("global_step6", "pytorch_model_fsdp_0"):
        _checkpoint(tmp_path / shard / "checkpoint-6", weights=False)
        assert checkpoint_problem(str(tmp_path / shard / "checkpoint-6")) == "no model weights"
        os.makedirs(tmp_path / shard / "checkpoint-6" / shard)
        assert checkpoint_problem(str(tmp_path / shard / "checkpoint-6")) is None


def test_resume_true_passes_over_a_checkpoint_without_weights(tmp_path, caplog):
    """The layout an older version left when killed mid-save (configs and hf_stable state, no weights) is skipped."""
    make(tmp_path, max_steps=2).train()
    _checkpoint(tmp_path / "checkpoint-4", weights=False, trainer_state=None, extra=("config.json",))
    (tmp_path / "checkpoint-4" / "hf_stable_state.json").write_text(json.dumps({}))
    caplog.set_level(logging.INFO, logger="hf_stable.trainers._base")
    trainer = make(tmp_path, max_steps=4)
    trainer.train(resume_from_checkpoint=True)
    assert f"skips {tmp_path / 'checkpoint-4'}: no model weights." in caplog.text
    assert f"resumes from {tmp_path / 'checkpoint-2'}." in caplog.text
    assert trainer.state.global_step == 4


def test_resume_true_without_a_complete_checkpoint_names_the_folder(tmp_path):
    _checkpoint(tmp_path / "checkpoint-3", weights=False)
    trainer = make(tmp_path)
    with pytest.raises(ValueError, match=r"no complete checkpoint in output_dir=.*\(skipped: checkpoint-3\)"):
        trainer.train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------------------------------------------------
# a full disk


@pytest.fixture
def small_file_limit():
    """Writes past 128 KiB fail inside the kernel (EFBIG, as ENOSPC would on a full disk) for every writer:
    safetensors' Rust writer, `torch.save`'s zip writer, Python's `open`. The tiny model's weights are ~360 KiB."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def arm():
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, hard))

    yield arm
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def test_full_disk_during_a_checkpoint_names_it_and_leaves_nothing(tmp_path, small_file_limit):
    trainer = make(tmp_path, max_steps=2)
    small_file_limit()
    with pytest.raises(OSError, match=f"could not save to {tmp_path / 'checkpoint-2'}: .*File too large"):
        trainer.train()
    assert not [n for n in os.listdir(tmp_path) if "checkpoint" in n]


def test_no_space_while_writing_the_optimizer_keeps_the_errno(tmp_path, monkeypatch):
    """ENOSPC raised by the optimizer's write, after the weights were staged: the error keeps its errno and names
    the checkpoint, and the staged weights are removed with the rest."""
    save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    trainer = make(tmp_path, max_steps=2)
    with pytest.raises(OSError, match=f"could not save to {tmp_path / 'checkpoint-2'}: No space left") as info:
        trainer.train()
    assert info.value.errno == errno.ENOSPC
    assert not [n for n in os.listdir(tmp_path) if "checkpoint" in n]


def test_full_disk_during_save_model_leaves_the_earlier_model_whole(tmp_path, small_file_limit):
    trainer = make(tmp_path / "out", max_steps=1, save_strategy="no")
    trainer.train()
    trainer.save_model()
    before = {n: (tmp_path / "out" / n).read_bytes() for n in ("config.json", "model.safetensors")}
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    small_file_limit()
    with pytest.raises(OSError, match=f"could not save to {tmp_path / 'out'}: .*File too large"):
        trainer.save_model()
    assert {n: (tmp_path / "out" / n).read_bytes() for n in before} == before
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith("tmp-")]
    # a first save into a fresh folder leaves no config.json without weights
    with pytest.raises(OSError, match=f"could not save to {tmp_path / 'fresh'}"):
        trainer.save_model(str(tmp_path / "fresh"))
    assert os.listdir(tmp_path / "fresh") == []


# ---------------------------------------------------------------------------------------------------------------------
# what the staging must not change


class _Recorder(TrainerCallback):
    """A callback with state inside the checkpoint: written into the staged folder, before the rename."""

    def __init__(self):
        self.folders = []

    def write_checkpoint_state(self, folder, args, state):
        self.folders.append(folder)
        if args.should_save:
            with open(os.path.join(folder, "recorder.json"), "w") as f:
                json.dump({"step": state.global_step}, f)


def test_callback_state_is_written_inside_the_atomic_save(tmp_path):
    trainer = make(tmp_path, max_steps=2)
    recorder = _Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert recorder.folders == [str(tmp_path / "tmp-checkpoint-2" / "checkpoint-2")]
    assert json.loads((tmp_path / "checkpoint-2" / "recorder.json").read_text()) == {"step": 2}


def test_save_model_replaces_stale_shards_and_writes_configs_last(tmp_path, monkeypatch):
    from hf_stable.trainers import _atomic

    final, staged = tmp_path / "out", tmp_path / "out" / "tmp-save_model"
    os.makedirs(staged)
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "notes.txt"):
        (final / name).write_text("old")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (staged / name).write_text("new")
    moved = []
    replace = os.replace
    monkeypatch.setattr(_atomic.os, "replace", lambda a, b: (moved.append(os.path.basename(b)), replace(a, b)))
    _atomic.publish_files(str(staged), str(final))
    assert moved[-1] == "config.json" and sorted(moved) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors", "notes.txt", "tokenizer.json"]
    assert (final / "config.json").read_text() == "new" and (final / "notes.txt").read_text() == "old"


def test_best_checkpoint_and_rotation_use_the_final_names(tmp_path):
    """`load_best_model_at_end` with `save_total_limit=1`: the best checkpoint is recorded under its final name,
    in memory and in its own trainer_state.json, survives rotation, and is what the run ends with."""
    trainer = make(
        tmp_path,
        eval_strategy="steps",
        eval_steps=SAVE_STEPS,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        save_total_limit=1,
        per_device_eval_batch_size=8,
        eval_dataset=arithmetic_dataset(8, seed=5),
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert os.path.dirname(best) == str(tmp_path) and os.path.basename(best).startswith("checkpoint-")
    assert [n for n in os.listdir(tmp_path) if "checkpoint" in n] == [os.path.basename(best)]
    with open(os.path.join(best, "trainer_state.json")) as f:
        assert json.load(f)["best_model_checkpoint"] == best
    saved = load_file(os.path.join(best, "model.safetensors"))
    for name, value in saved.items():
        assert torch.equal(value, trainer.model.state_dict()[name]), name


def test_save_model_into_a_file_names_it(tmp_path):
    trainer = make(tmp_path / "out", max_steps=1, save_strategy="no")
    (tmp_path / "taken").write_text("a file where the output folder should be")
    with pytest.raises(OSError, match=f"could not save to {tmp_path / 'taken'}: "):
        trainer.save_model(str(tmp_path / "taken"))
    assert (tmp_path / "taken").read_text().startswith("a file")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_rename_after_both_wrote(tmp_path):
    """Under DDP (gloo, two CPU processes) every rank writes its RNG file into the same staging folder and the main
    process renames only once both are done; resume with True continues on both ranks."""
    from launch_helpers import launch_two_processes

    launch_two_processes(os.path.join(os.path.dirname(__file__), "atomic_ddp_script.py"), str(tmp_path), port=29753)
    assert json.loads((tmp_path / "report.json").read_text()) == {"global_step": 6}
    checkpoints = sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n)
    assert checkpoints == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for step in (2, 4, 6):
        names = os.listdir(tmp_path / f"checkpoint-{step}")
        assert {"rng_state_0.pth", "rng_state_1.pth", "hf_stable_state.json", "model.safetensors"} <= set(names)

"""MaPCallback on a real (tiny) training run: the merged model is the mean of independently recorded snapshots, the
logged pass@k equals an independent evaluation of that mean, merging changes the metric, training is unchanged by
the callback, and a resumed run logs the same metrics bit for bit (the WSM window machinery, `map_state/`)."""

import io
import json

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from wsm_helpers import Recorder, StopAt, make_trainer, tiny_model

from hf_stable.callbacks.map_eval import MAP_PAPER, MaPCallback
from hf_stable.evaluation.map_eval import evaluate_pass_at_k


ACCEPTED = "0123456789abcdefghijklmnopqrstuvwxyz"
PROMPTS = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": ACCEPTED} for a in (3, 12, 40, 77) for b in (5, 9, 21)])


def first_char_digit(completion, answer):
    """Correct when the first generated character is a digit or a lowercase letter (about 40% of the vocabulary): a
    pass@k strictly between 0 and 1 that moves with the weights of a random model."""
    return bool(completion) and completion[0] in answer


def _callback(**kw):
    _, tokenizer = tiny_model()
    settings = dict(
        num_checkpoints=3,
        interval_steps=2,
        ks=(1, 2),
        num_samples=4,
        scorer=first_char_digit,
        max_new_tokens=1,
        storage="cpu",
        tokenizer=tokenizer,
        log_unmerged=True,
    )
    settings.update(kw)
    return MaPCallback(PROMPTS, **settings)


def _map_logs(trainer):
    return {h["step"]: {k: v for k, v in h.items() if k.startswith("eval/map/")} for h in trainer.state.log_history
            if "eval/map/pass@1" in h}


def _eval_args(**kw):
    return dict(max_steps=8, eval_dataset=True, eval_strategy="steps", eval_steps=2, learning_rate=0.05, **kw)


def test_logged_pass_at_k_is_the_merged_models(tmp_path):
    recorder = Recorder()
    cb = _callback()
    trainer = make_trainer(tmp_path / "map", [recorder, cb], **_eval_args())
    cb.trainer = trainer
    trainer.train()
    logs = _map_logs(trainer)
    assert sorted(logs) == [2, 4, 6, 8]
    assert [logs[s]["eval/map/num_checkpoints"] for s in (2, 4, 6, 8)] == [2, 3, 3, 3]
    assert cb.steps == [4, 6, 8] and (cb.k, cb.s) == (2, 2)
    # the window's merge is the mean of the three recorded snapshots (fp32 window: base + deltas)
    merged, w = cb.merged_state()
    mean = {n: sum(recorder.snapshots[t][n] for t in (4, 6, 8)) / 3 for n in merged}
    for n, want in mean.items():
        torch.testing.assert_close(merged[n].double(), want, atol=1e-6, rtol=0, msg=n)
    assert w == pytest.approx([2 / 3, 1 / 3])  # uniform over θ^(4), θ^(6), θ^(8)
    # independent: load the fp64 mean into a fresh model and evaluate it with the same settings
    model, tokenizer = tiny_model()
    kw = dict(ks=(1, 2), num_samples=4, scorer=first_char_digit, max_new_tokens=1, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(mean[n].float())
    want = evaluate_pass_at_k(model, tokenizer, PROMPTS, **kw)
    assert logs[8]["eval/map/pass@1"] == pytest.approx(want["pass@1"], abs=1e-12)
    assert logs[8]["eval/map/pass@2"] == pytest.approx(want["pass@2"], abs=1e-12)
    unmerged = evaluate_pass_at_k(trainer.model, tokenizer, PROMPTS, **kw)
    assert logs[8]["eval/map/unmerged/pass@1"] == unmerged["pass@1"]
    # merging changes the logged metric
    assert any(logs[s]["eval/map/pass@1"] != logs[s]["eval/map/unmerged/pass@1"] for s in (4, 6, 8))
    # the training itself is untouched by the evaluations (weights restored, sampling RNG forked)
    plain = make_trainer(tmp_path / "plain", [], **_eval_args())
    plain.train()
    for (n, a), (_, b) in zip(trainer.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_resume_logs_the_same_metrics(tmp_path):
    common = _eval_args(save_strategy="steps", save_steps=4)
    full = _callback()
    t_full = make_trainer(tmp_path / "full", [full], **common)
    full.trainer = t_full
    t_full.train()
    first = _callback()
    t_first = make_trainer(tmp_path / "split", [first, StopAt(4)], **common)
    first.trainer = t_first
    t_first.train()
    state = json.loads((tmp_path / "split" / "checkpoint-4" / "map_state" / "map_state.json").read_text())
    assert state["steps"] == [0, 2, 4] and not (tmp_path / "split" / "checkpoint-4" / "wsm_state").exists()
    second = _callback()
    t_second = make_trainer(tmp_path / "split", [second], **common)
    second.trainer = t_second
    t_second.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-4"))
    assert second.steps == full.steps == [4, 6, 8]
    a, b = _map_logs(t_full), _map_logs(t_second)
    assert a[6] == b[6] and a[8] == b[8]
    (ma, _), (mb, _) = full.merged_state(), second.merged_state()
    for n in ma:
        assert torch.equal(ma[n], mb[n]), n


def test_without_resume_state_the_window_restarts(tmp_path, caplog):
    """Control for the resume test: a resumed run that lost `map_state/` logs different (fewer-member) merges."""
    import shutil

    common = _eval_args(save_strategy="steps", save_steps=4)
    first = _callback()
    t_first = make_trainer(tmp_path, [first, StopAt(4)], **common)
    first.trainer = t_first
    t_first.train()
    shutil.rmtree(tmp_path / "checkpoint-4" / "map_state")
    second = _callback()
    t_second = make_trainer(tmp_path, [second], **common)
    second.trainer = t_second
    t_second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert _map_logs(t_second)[6]["eval/map/num_checkpoints"] == 2 and second.steps == [4, 6, 8]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(num_checkpoints=1), "num_checkpoints"),
        (dict(num_checkpoints=True), "num_checkpoints"),
        (dict(interval_steps=0), "interval_steps"),
        (dict(interval_steps=None, window_fraction=0.0), "window_fraction"),
        (dict(ks=(5,)), "ks"),
        (dict(ks=()), "ks"),
        (dict(num_samples=0), "num_samples"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.0), "num_samples"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(batch_size=0), "batch_size"),
        (dict(storage="gpu"), "storage"),
    ],
)
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        _callback(**kw)


def test_validation_of_dataset_scorer_and_trainer(tmp_path):
    with pytest.raises(ValueError, match="`eval_dataset`"):
        MaPCallback(Dataset.from_list([{"prompt": "1+1="}]))
    with pytest.raises(TypeError, match="`scorer`"):
        MaPCallback(PROMPTS, scorer="exact")
    with pytest.raises(ValueError, match="needs the trainer"):
        make_trainer(tmp_path, [_callback()], max_steps=2).train()


def test_pass_at_k_settings_are_evaluate_pass_at_ks():
    """The callback takes `evaluate_pass_at_k`'s settings with that function's defaults; a misspelt one is refused by
    name with the list of settings (not silently dropped into `**pass_at_k`)."""
    cb = MaPCallback(PROMPTS)
    assert (cb.ks, cb.num_samples, cb.scorer, cb.max_new_tokens) == ((1,), 8, None, 16)
    assert (cb.temperature, cb.top_p, cb.seed, cb.batch_size) == (1.0, 1.0, 0, 32)
    cb = MaPCallback(PROMPTS, ks=2, num_samples=3, temperature=0.5, top_p=0.9, seed=7, max_new_tokens=4, batch_size=5)
    assert (cb.ks, cb.num_samples, cb.temperature, cb.top_p, cb.seed) == ((2,), 3, 0.5, 0.9, 7)
    assert (cb.max_new_tokens, cb.batch_size) == (4, 5)
    with pytest.raises(TypeError, match=r"\['num_sample'\].*'num_samples'"):
        MaPCallback(PROMPTS, num_sample=4)


def test_listed_under_evaluation_with_its_paper():
    from hf_stable.registry import get_registry, list_methods

    method = get_registry("evaluation").get("map")
    assert method.fn is MaPCallback and method.paper is MAP_PAPER and MAP_PAPER.arxiv == "2510.09295"
    out = io.StringIO()
    assert list_methods("evaluation", file=out) == {"evaluation": ["map", "mmc"]}
    assert "https://arxiv.org/abs/2510.09295" in out.getvalue()


def test_disk_window_has_its_own_folder(tmp_path):
    """With `storage="disk"` the window lives in `output_dir/map_window/` (not WSM's `wsm_window/`), beside a
    WSMCallback in the same trainer, and the scratch folder is removed at train end."""
    from hf_stable.callbacks import WSMCallback

    seen = {}

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen[state.global_step] = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith("_window"))

    cb = _callback(storage="disk")
    wsm = WSMCallback(interval_steps=2, num_intervals=2, storage="disk", merge_at=("end",))
    trainer = make_trainer(tmp_path, [cb, wsm, Look()], **_eval_args())
    cb.trainer = trainer
    trainer.train()
    assert seen[8] == ["map_window", "wsm_window"]
    assert not (tmp_path / "map_window").exists() and (tmp_path / "wsm-merged").exists()
    assert _map_logs(trainer)[8]["eval/map/num_checkpoints"] == 3

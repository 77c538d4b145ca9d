"""WSMCallback on a real (tiny) training run: the merge equals Σ c_j θ^(j) over independently recorded snapshots,
the window slides, merged evaluation swaps weights in and out bit-exactly, and a resumed run equals an uninterrupted
one (spec merging.md §4.3; DESIGN.md "State survives")."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from wsm_helpers import Recorder, StopAt, make_trainer

from hf_stable.callbacks import WSMCallback
from hf_stable.merging.wsm import wsm_weights


def expected_merge(recorder, steps, schedule="1-sqrt", **kw):
    _, c = wsm_weights(schedule, len(steps) - 1, **kw)
    snaps = [recorder.snapshots[t] for t in steps]
    return {n: sum(cj * s[n] for cj, s in zip(c, snaps, strict=True)) for n in snaps[0]}


def assert_close_state(actual, expected, atol=1e-6):
    for name, want in expected.items():
        assert name in actual, name
        torch.testing.assert_close(actual[name].double(), want, atol=atol, rtol=0, msg=name)


def saved_weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize(("storage", "merge_at"), [("cpu", ("end",)), ("disk", ("end", "save"))])
def test_end_merge_matches_snapshots(tmp_path, storage, merge_at):
    recorder = Recorder()
    cb = WSMCallback(schedule="1-sqrt", interval_steps=2, num_intervals=4, storage=storage, merge_at=merge_at)
    trainer = make_trainer(tmp_path, [recorder, cb], max_steps=16, save_strategy="steps", save_steps=8)
    trainer.train()
    # "end" only: the grid starts D = 8 steps before the end; "save": right after warm-up (step 0), slides to 8..16
    assert cb.steps == [8, 10, 12, 14, 16] and (cb.k, cb.s) == (4, 2)
    out = tmp_path / "wsm-merged"
    assert_close_state(saved_weights(out), expected_merge(recorder, cb.steps))
    card = (out / "README.md").read_text()
    assert "WSM" in card and "1-sqrt" in card and "k = 4" in card and "s = 2" in card
    assert not (tmp_path / "wsm-merged.tmp").exists()
    assert (out / "config.json").exists()
    state = json.loads((tmp_path / "checkpoint-16" / "wsm_state" / "wsm_state.json").read_text())
    assert state["steps"] == [8, 10, 12, 14, 16]
    if "save" in merge_at:
        # the merge saved at step 8: window [0, 2, 4, 6, 8]
        assert_close_state(
            saved_weights(tmp_path / "checkpoint-8" / "wsm-merged"), expected_merge(recorder, [0, 2, 4, 6, 8])
        )
        assert not (tmp_path / "wsm_window").exists()  # disk scratch removed at train end
    else:
        assert not (tmp_path / "checkpoint-8" / "wsm-merged").exists()
        assert json.loads((tmp_path / "checkpoint-8" / "wsm_state" / "wsm_state.json").read_text())["steps"] == [8]


def test_sliding_partial_windows_and_merged_eval(tmp_path):
    recorder = Recorder()
    cb = WSMCallback(schedule="cosine", window_steps=6, interval_steps=2, merge_at=("eval",), storage="cpu")
    trainer = make_trainer(
        tmp_path, [recorder, cb], max_steps=10, eval_dataset=True, eval_strategy="steps", eval_steps=2
    )
    cb.trainer = trainer
    trainer.train()
    assert cb.k == 3 and cb.steps == [4, 6, 8, 10]
    evals = [h for h in trainer.state.log_history if "eval_wsm_loss" in h]
    assert [h["step"] for h in evals] == [2, 4, 6, 8, 10]  # first window member at step 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.evaluate()
    assert "eval_wsm_loss" in metrics and "eval_loss" in metrics
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} not restored bit-exactly"
    # independent: load Σ c_j θ^(j) into the model and evaluate normally
    merged = expected_merge(recorder, [4, 6, 8, 10], schedule="cosine")
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            p.copy_(merged[n])
    cb.merge_at = ()  # plain evaluation now
    assert trainer.evaluate()["eval_loss"] == pytest.approx(metrics["eval_wsm_loss"], rel=1e-5)
    m_state, w = cb.merged_state()
    assert len(w) == 3 and m_state is not None


def test_resume_equals_uninterrupted(tmp_path):
    settings = dict(schedule="1-sqrt", interval_steps=2, num_intervals=4, storage="cpu")
    common = dict(max_steps=12, save_strategy="steps", save_steps=6)
    full = WSMCallback(**settings)
    make_trainer(tmp_path / "full", [full], **common).train()
    first = WSMCallback(**settings)
    make_trainer(tmp_path / "split", [first, StopAt(6)], **common).train()
    assert first.steps == [4, 6]  # stopped mid-window
    second = WSMCallback(**settings)
    trainer = make_trainer(tmp_path / "split", [second], **common)
    trainer.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-6"))
    assert second.steps == full.steps == [4, 6, 8, 10, 12]
    a, b = saved_weights(tmp_path / "full" / "wsm-merged"), saved_weights(tmp_path / "split" / "wsm-merged")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_warnings_and_validation(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_stable.callbacks.wsm"):
        cb = WSMCallback(interval_steps=1, num_intervals=2)
        make_trainer(tmp_path, [cb], max_steps=3, lr_scheduler_type="linear").train()
    assert "constant" in caplog.text and "lr_scheduler_type='linear'" in caplog.text
    with pytest.raises(ValueError, match="merge_at"):
        WSMCallback(merge_at=("never",))
    with pytest.raises(ValueError, match="storage"):
        WSMCallback(storage="gpu")
    with pytest.raises(ValueError, match="delta_dtype"):
        WSMCallback(delta_dtype="int8")
    with pytest.raises(ValueError, match="Unknown WSM"):
        WSMCallback(schedule="cosin")
    with pytest.raises(ValueError, match="hub_repo_id"):
        WSMCallback(push_to_hub=True)
    cb = WSMCallback(merge_at=("eval",))
    with pytest.raises(ValueError, match=r"callback\.trainer"):
        make_trainer(tmp_path / "e", [cb], max_steps=2).train()


def test_bfloat16_deltas_close(tmp_path):
    recorder = Recorder()
    cb = WSMCallback(schedule="linear", interval_steps=2, num_intervals=3, delta_dtype="bfloat16")
    make_trainer(tmp_path, [recorder, cb], max_steps=8).train()
    got = saved_weights(tmp_path / "wsm-merged")
    want = expected_merge(recorder, cb.steps, schedule="linear")
    for name, w in want.items():  # bf16 deltas: relative error ~2^-9 of each delta
        delta_scale = (recorder.snapshots[8][name] - recorder.snapshots[2][name]).abs().max()
        assert (got[name].double() - w).abs().max() <= 2**-7 * delta_scale + 1e-7

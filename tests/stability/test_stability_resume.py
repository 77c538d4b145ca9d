"""Interrupted and resumed equals uninterrupted, bitwise, with the stability callbacks on (issue: the guard's
snapshots lived in memory only, so a resumed run rolled back to another step than the uninterrupted one).

Each case trains 10 steps with AdamW, saving at step 5; a second trainer resumes from that checkpoint into another
folder. A gradient ×100 at step 8 makes the guard roll back after the resume point, to the snapshot it took before it.
"""

import json

import pytest
import torch
from grpo_helpers import GRPO_ARGS, deterministic_rollout
from sft_helpers import STEP_ARGS

from hf_stable.callbacks import ComponentClipCallback, FaultInjectionCallback, StabilityGuardCallback
from hf_stable.testing import arithmetic_dataset, arithmetic_reward, build_tiny_model


STEPS, SAVE, FAULT = 10, 5, 8
RUN = dict(max_steps=STEPS, save_strategy="steps", save_steps=SAVE, optim="adamw_torch", learning_rate=1e-3,
           max_grad_norm=0.0, logging_steps=1, seed=0)  # fmt: skip
CALLBACKS = {
    "none": {},
    # candidate at 2, confirmed at 3; candidate at 5 (pending in the checkpoint), confirmed at 6; rollback at 8 to 5
    "guard": dict(stability_guard=True, guard_action="rollback", guard_min_history=2, guard_snapshot_every=3,
                  guard_confirm_steps=1, guard_loss_z=None),
    "clip": dict(component_clip_max_norm=0.05),
    # moments reset at steps 3, 6 and 9, the momentum decays over the run: the optimizer's state crosses the resume
    "stable_spam": dict(stable_spam=True, stable_spam_reset_interval=3, stable_spam_decay_steps=STEPS),
    "clip_adaptive": dict(component_clip_max_norm=0.05, component_clip_mode="adaptive",
                          component_clip_adaptive_warmup_steps=2),
}  # fmt: skip


def _trainer(kind, output_dir, callback):
    from hf_stable import StableGRPOConfig, StableGRPOTrainer, StableSFTConfig, StableSFTTrainer

    model, tokenizer = build_tiny_model(seed=0)
    torch.manual_seed(0)
    if kind == "sft":
        args = StableSFTConfig(str(output_dir), per_device_train_batch_size=4,
                               **{**STEP_ARGS, **RUN, **CALLBACKS[callback]})  # fmt: skip
        trainer = StableSFTTrainer(model=model, args=args, processing_class=tokenizer,
                                   train_dataset=arithmetic_dataset(4 * STEPS, seed=1, max_operand=99))  # fmt: skip
    else:
        args = StableGRPOConfig(str(output_dir), per_device_train_batch_size=8,
                                **{**GRPO_ARGS, **RUN, **CALLBACKS[callback]})  # fmt: skip
        trainer = StableGRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=args,
                                    processing_class=tokenizer, rollout_func=deterministic_rollout,
                                    train_dataset=arithmetic_dataset(8 * STEPS, seed=0, max_operand=9))  # fmt: skip
    FaultInjectionCallback.attach(trainer, kind="loss_scale", steps=[FAULT], factor=100.0)
    return trainer


def _decisions(trainer):
    guards = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StabilityGuardCallback)]
    return [(d.step, d.kind, d.action, d.restore_step) for d in guards[0].decisions] if guards else None


@pytest.mark.parametrize("callback", sorted(CALLBACKS))
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_interrupted_and_resumed_equals_uninterrupted_bitwise(tmp_path, kind, callback):
    full = _trainer(kind, tmp_path / "full", callback)
    full.train()
    resumed = _trainer(kind, tmp_path / "resumed", callback)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{SAVE}"))
    assert resumed.state.global_step == full.state.global_step == STEPS
    if callback == "guard":  # the guard acted after the resume point, in both runs
        index = tmp_path / "full" / f"checkpoint-{SAVE}" / "stable_guard" / "guard" / "index.json"
        saved = json.loads(index.read_text())
        assert saved == {"candidate": SAVE, "confirmed": [2]}
        assert (FAULT, "grad", "rollback", SAVE) in _decisions(full)
        assert [d for d in _decisions(full) if d[0] > SAVE] == _decisions(resumed)
    if callback.startswith("clip"):
        assert any(isinstance(cb, ComponentClipCallback) for cb in resumed.callback_handler.callbacks)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max |Δ| = {(p - q).abs().max().item():.3g}"


# -- the pieces ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_store_export_and_import_round_trip_every_slot(tmp_path, storage):
    from hf_stable.stability.snapshot import SnapshotStore, take_snapshot

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    store = SnapshotStore("cpu", history=2)
    for step in (2, 4, 6):
        with torch.no_grad():
            model.weight.add_(step)
        store.put_candidate(take_snapshot(step, model.named_parameters(), optimizer))
        if step < 6:
            store.confirm_candidate()
    index = store.export_to(str(tmp_path / "ckpt"))
    assert index == {"candidate": 6, "confirmed": [2, 4]}
    other = SnapshotStore(storage, folder=str(tmp_path / "live"), history=2)
    other.import_from(str(tmp_path / "ckpt"), index)
    assert (other.candidate_step, other.confirmed_steps) == (6, [2, 4])
    for mine, theirs in [(store.candidate, other._load_any(other.candidate, "candidate"))] + [
        (a, other._load(b)) for a, b in zip(store.confirmed, other.confirmed, strict=True)
    ]:
        assert mine.step == theirs.step
        assert all(torch.equal(mine.params[k], theirs.params[k]) for k in mine.params)
        assert torch.equal(mine.optimizer["state"][0]["exp_avg"], theirs.optimizer["state"][0]["exp_avg"])


def test_policy_with_its_candidate_continues_identically():
    from hf_stable.stability.guard import GuardPolicy

    def policy():
        return GuardPolicy(window=32, min_history=5, snapshot_every=4, confirm_steps=2)

    signals = [(2.0 + 0.01 * (i % 3), 1.0 + 0.02 * (i % 4)) for i in range(20)]
    a, b = policy(), policy()
    for i in range(13):
        a.decide(i + 1, *signals[i])
    assert a.candidate_step == 13  # pending at the save
    b.load_state(json.loads(json.dumps(a.state())), a.confirmed_steps, candidate_available=True)
    rest_a = [a.decide(i + 1, *signals[i]) for i in range(13, 20)]
    rest_b = [b.decide(i + 1, *signals[i]) for i in range(13, 20)]
    assert [d.ops for d in rest_a] == [d.ops for d in rest_b] and a.state() == b.state()
    lost = policy()  # without the candidate: a fresh snapshot schedule, another history
    lost.load_state(json.loads(json.dumps(a.state())), [])
    assert lost.candidate_step is None

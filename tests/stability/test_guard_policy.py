"""The guard's decision state machine on hand-made signal sequences."""

import json
import math

import pytest

from hf_stable.stability.guard import GuardPolicy


def _policy(**kw):
    defaults = dict(window=32, min_history=5, snapshot_every=4, confirm_steps=2, lr_cooldown_steps=4,
                    lr_cooldown_factor=0.25, max_rollbacks=2)
    return GuardPolicy(**{**defaults, **kw})


def _healthy(i):
    return 2.0 + 0.01 * ((i * 7) % 5), 1.0 + 0.02 * ((i * 3) % 4)


def _run(policy, signals, start=1):
    return [policy.decide(start + i, loss, grad) for i, (loss, grad) in enumerate(signals)]


def test_healthy_steps_fill_windows_and_take_then_confirm_snapshots():
    policy = _policy()
    decisions = _run(policy, [_healthy(i) for i in range(12)])
    assert all(d.action == "accept" for d in decisions)
    ops = {d.step: d.ops for d in decisions if d.ops}
    # first candidate once min_history (5) values are accepted; confirmed after 2 more healthy steps; then every 4
    assert ops == {5: ["candidate"], 7: ["confirm"], 9: ["candidate"], 11: ["confirm"]}
    assert policy.confirmed_steps == [9]  # history=1 keeps the newest only
    assert len(policy.loss_window) == 12


def test_one_corrupted_step_is_skipped_and_does_not_enter_the_window():
    policy = _policy()
    _run(policy, [_healthy(i) for i in range(12)])
    before = policy.loss_window.values()
    d = policy.decide(13, 9.0, 1.0)
    assert (d.kind, d.action) == ("loss", "skip")
    assert d.loss_z > 6
    assert policy.loss_window.values() == before
    d = policy.decide(14, *_healthy(14))
    assert d.action == "accept" and policy.consecutive == 0
    assert (policy.anomalies, policy.skips, policy.rollbacks) == (1, 1, 0)


def test_persistent_anomaly_skips_then_rolls_back_with_cooldown():
    policy = _policy()
    _run(policy, [_healthy(i) for i in range(12)])  # confirmed snapshot at 9
    d = policy.decide(13, *_healthy(13))  # a candidate is taken at 13
    assert d.ops == ["candidate"]
    skip = policy.decide(14, 9.0, 30.0)
    assert skip.action == "skip" and skip.ops == ["discard"]  # the candidate may hold the damage
    roll = policy.decide(15, 9.5, 30.0)
    assert roll.action == "rollback" and roll.restore_step == 9
    # cooldown over the next 4 updates: 0.25, 0.4375, 0.625, 0.8125, then 1
    mults = [policy.decide(16 + k, *_healthy(k)).lr_multiplier for k in range(5)]
    assert mults == pytest.approx([0.25, 0.4375, 0.625, 0.8125, 1.0])


def test_nonfinite_twice_in_a_row_rolls_back_even_with_more_skips_allowed():
    policy = _policy(skips_before_rollback=5)
    _run(policy, [_healthy(i) for i in range(12)])
    assert policy.decide(13, math.nan, 1.0).action == "skip"
    assert policy.decide(14, 2.0, math.inf).action == "rollback"


def test_no_confirmed_snapshot_falls_back_to_skip():
    policy = _policy(action="rollback")
    _run(policy, [_healthy(i) for i in range(5)])  # candidate at 5, not confirmed yet
    d = policy.decide(6, math.nan, 1.0)
    assert d.action == "skip" and "no confirmed snapshot" in d.reason
    assert policy.rollbacks == 0


def test_repeated_rollback_to_the_same_snapshot_drops_it_for_the_older_one():
    policy = _policy(action="rollback", snapshot_history=2, max_rollbacks=9)
    _run(policy, [_healthy(i) for i in range(12)])
    assert policy.confirmed_steps == [5, 9]
    assert policy.decide(13, math.nan, 1.0).restore_step == 9
    d = policy.decide(14, math.nan, 1.0)  # within the cooldown, again to 9: 9 may be bad, go to 5
    assert d.ops == ["drop_newest"] and d.restore_step == 5
    assert policy.confirmed_steps == [5]


@pytest.mark.parametrize("on_exhausted", ["stop", "raise", "continue"])
def test_max_rollbacks_then_on_exhausted(on_exhausted):
    policy = _policy(action="rollback", max_rollbacks=2, on_exhausted=on_exhausted)
    _run(policy, [_healthy(i) for i in range(8)])
    actions = [policy.decide(9 + k, math.nan, 1.0).action for k in range(4)]
    expected_third = "rollback" if on_exhausted == "continue" else on_exhausted
    assert actions[:3] == ["rollback", "rollback", expected_third]
    if on_exhausted == "continue":
        assert policy.exhausted and actions[3] == "log"


def test_log_action_never_drops_an_update():
    policy = _policy(action="log")
    _run(policy, [_healthy(i) for i in range(8)])
    d = policy.decide(9, math.nan, math.nan)
    assert d.kind == "nonfinite" and d.action == "log" and not d.drops_update
    assert policy.confirmed_steps == []  # no snapshots without a rollback action


def test_degrade_for_post_step_maps_actions():
    for before, after in [("skip_then_rollback", "rollback"), ("skip", "log"), ("rollback", "rollback")]:
        policy = _policy(action=before)
        policy.degrade_for_post_step()
        assert policy.action == after


def test_state_round_trip_continues_identically():
    a = _policy()
    signals = [_healthy(i) for i in range(12)] + [(9.0, 30.0), (9.0, 30.0)] + [_healthy(i) for i in range(6)]
    _run(a, signals[:12])  # no candidate pending at step 12 (a pending one does not survive a restart)
    b = _policy()
    b.load_state(json.loads(json.dumps(a.state())), confirmed_available=a.confirmed_steps)
    da, db = _run(a, signals[12:], start=13), _run(b, signals[12:], start=13)
    assert [d.action for d in da][:2] == ["skip", "rollback"]
    assert [(x.action, x.restore_step) for x in da] == [(y.action, y.restore_step) for y in db]
    assert a.fingerprint() == b.fingerprint()


def test_invalid_choices_name_the_field():
    with pytest.raises(ValueError, match="`action`='bogus'"):
        GuardPolicy(action="bogus")
    with pytest.raises(ValueError, match="`on_exhausted`"):
        GuardPolicy(on_exhausted="later")

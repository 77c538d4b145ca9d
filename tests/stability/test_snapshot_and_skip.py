import copy

import pytest
import torch

from hf_stable.stability.snapshot import (
    SnapshotStore,
    expected_snapshot_nbytes,
    restore_snapshot,
    snapshot_nbytes,
    take_snapshot,
)
from hf_stable.stability.update import drop_update, force_scaler_skip, scale_lr


def _model_and_adamw(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _opt_state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, value in a["state"][k].items():
            assert torch.equal(value, b["state"][k][name]), name


@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_restore_is_bit_identical_for_params_and_adamw_state(tmp_path, storage):
    model, opt, sched = _model_and_adamw()
    _train(model, opt, sched, 3)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_before = copy.deepcopy(opt.state_dict())
    store = SnapshotStore(storage, folder=str(tmp_path / "snaps"))
    store.put_candidate(take_snapshot(4, model.named_parameters(), opt, sched))
    store.confirm_candidate()
    _train(model, opt, sched, 5, seed=2)  # perturb weights, moments, step counters and the schedule
    snap = store.newest_confirmed()
    restore_snapshot(snap, model.named_parameters(), opt, sched, restore_scheduler=True, restore_hyperparameters=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, params_before[n]), n
    _opt_state_equal(opt.state_dict(), opt_before)
    assert sched.last_epoch == 3
    # the optimizer state is keyed by the parameter objects, which were written in place, not rebound
    assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}


def test_keep_policy_keeps_the_current_learning_rate():
    model, opt, sched = _model_and_adamw()
    _train(model, opt, sched, 2)
    snap = take_snapshot(3, model.named_parameters(), opt, sched)
    _train(model, opt, sched, 4)
    lr_now = opt.param_groups[0]["lr"]
    restore_snapshot(snap, model.named_parameters(), opt, sched)
    assert opt.param_groups[0]["lr"] == lr_now and sched.last_epoch == 6


def test_snapshot_memory_equals_the_formula():
    model, opt, sched = _model_and_adamw()
    _train(model, opt, sched, 1)
    n = sum(p.numel() for p in model.parameters())
    snap = take_snapshot(1, model.named_parameters(), opt)
    # fp32 AdamW: weight + exp_avg + exp_avg_sq = 12 bytes per parameter, plus a 4-byte step per tensor
    assert snapshot_nbytes(snap) == 12 * n + 4 * len(list(model.parameters()))
    assert expected_snapshot_nbytes(model.parameters(), opt) == snapshot_nbytes(snap)


def test_store_keeps_history_and_disk_slots_survive_a_new_store(tmp_path):
    model, opt, _ = _model_and_adamw()
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 1)
    store = SnapshotStore("disk", folder=str(tmp_path), history=2)
    for step in (5, 10, 15):
        store.put_candidate(take_snapshot(step, model.named_parameters(), opt))
        store.confirm_candidate()
    assert store.confirmed_steps == [10, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["confirmed-10", "confirmed-15"]
    store.put_candidate(take_snapshot(20, model.named_parameters(), opt))
    store.discard_candidate()
    assert not (tmp_path / "candidate").exists()
    resumed = SnapshotStore("disk", folder=str(tmp_path), history=2)
    assert resumed.adopt_disk_snapshots(max_step=12) == [10]
    assert resumed.newest_confirmed().step == 10


def test_true_skip_leaves_adamw_params_moments_and_step_unchanged():
    """Guards against a future torch change: AdamW must skip parameters whose grad is None."""
    model, opt, sched = _model_and_adamw()
    _train(model, opt, sched, 2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    model(torch.randn(4, 6)).sum().backward()
    assert drop_update(opt) == 4
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
    _opt_state_equal(opt.state_dict(), state)


def test_zeroed_grads_are_not_a_skip_for_adamw():
    model, opt, sched = _model_and_adamw()
    _train(model, opt, sched, 2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 6)).sum().backward()
    opt.zero_grad(set_to_none=False)
    opt.step()
    assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("unscaled", [True, False])
def test_gradscaler_skip_path_leaves_weights_and_lets_the_scale_be_restored(unscaled):
    model, opt, _ = _model_and_adamw()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(4, 6)).sum()).backward()
    scaler.step(opt)  # one real step so AdamW has state
    scaler.update()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 6)).sum()).backward()
    if unscaled:  # what accelerate's clip_grad_norm_ does before the callbacks run
        scaler.unscale_(opt)
    scale = force_scaler_skip(scaler, opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < scale  # the scaler backed off ...
    scaler.update(new_scale=scale)  # ... and the guard undoes it
    assert scaler.get_scale() == scale
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n


def test_scale_lr_undoes_in_any_order():
    _, opt, _ = _model_and_adamw()
    before = opt.param_groups[0]["lr"]
    scale_lr(opt, 0.25)
    scale_lr(opt, 100.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(25.0 * before)
    scale_lr(opt, 1 / 0.25)
    scale_lr(opt, 1 / 100.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(before, rel=1e-15)

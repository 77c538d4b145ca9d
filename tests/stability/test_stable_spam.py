"""Stable-SPAM (`hf_stable.stability.spam`, `StableSPAMCallback`, the ``stable_spam`` config fields).

The reference below is an independent re-derivation of the authors' optimizer (``galore_torch/stablespam.py`` of
``TianjinYellow/StableSPAM``, class ``StableSPAM.step``): a step-major loop over plain lists of tensors, with every
quantity named as in the paper's description (θ, γ₁, γ₂, the cosine momentum scale, the moment reset every ΔT steps
with the step count restarting at 1 and the reset moments taking effect from the next step). Our optimizer must give
the same parameters to 1e-6 on a tiny model with an injected gradient spike.
"""

import dataclasses
import io
import math
from types import SimpleNamespace

import pytest
import torch
from sft_helpers import STEP_ARGS, dataset_for

from hf_stable.callbacks import StableSPAMCallback
from hf_stable.stability.callback_configs import StableSPAMConfig, stable_spam_host_problems
from hf_stable.stability.spam import StableSPAM, momentum_scale, norm_rescale, spike_clip
from hf_stable.testing import build_tiny_model


HYPER = dict(gamma1=0.7, gamma2=0.9, theta=0.999, reset_interval=5, decay_steps=20, eta_min=0.5)


def reference_step(weights, grads, state, t, lrs, wds, betas=(0.9, 0.999), eps=1e-8, **hyper):
    """One step of the authors' update on lists of tensors, in place on ``weights`` (``state``: a dict of lists)."""
    theta, gamma1, gamma2 = hyper["theta"], hyper["gamma1"], hyper["gamma2"]
    total, eta = hyper["decay_steps"], hyper["eta_min"]
    s = 1.0 if total is None else eta + (1 - eta) * 0.5 * (1 + math.cos(math.pi * t / (total + 1)))
    gap = hyper["reset_interval"]
    for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
        if g is None:
            continue
        g = g.clone()
        w.mul_(1 - lrs[i] * wds[i])
        state["k"][i] += 1
        k = state["k"][i]
        biggest = g.abs().max()
        state["max"][i] = theta * state["max"][i] + (1 - theta) * biggest
        tau = state["max"][i] / (1 - theta**k)
        spiked = g.abs() > tau
        g[spiked] = g[spiked] / biggest * tau
        length = torch.norm(g)
        g1 = gamma1 * s
        state["m"][i] = g1 * state["m"][i] + (1 - g1) * length
        state["v"][i] = gamma2 * state["v"][i] + (1 - gamma2) * length**2
        ratio = (state["m"][i] / (1 - g1**k)) / (torch.sqrt(state["v"][i] / (1 - gamma2**k)) + eps)
        if length > 0:
            g = g / length * ratio
        reset = gap != 0 and t % gap == 0
        if reset:
            state["k"][i] = k = 1
        b1 = betas[0] * s
        m1 = state["M"][i] * b1 + (1 - b1) * g
        m2 = state["V"][i] * betas[1] + (1 - betas[1]) * g * g
        w.sub_(lrs[i] / (1 - b1**k) * m1 / (m2.sqrt() / math.sqrt(1 - betas[1] ** k) + eps))
        state["M"][i], state["V"][i] = (torch.zeros_like(m1), torch.zeros_like(m2)) if reset else (m1, m2)


def reference_state(weights):
    n = len(weights)
    return {"k": [0] * n, "max": [0.0] * n, "m": [0.0] * n, "v": [0.0] * n,
            "M": [torch.zeros_like(w) for w in weights], "V": [torch.zeros_like(w) for w in weights]}  # fmt: skip


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _loss(model, step):
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(step))
    y = torch.sin(x[:, :3] * 2)
    loss = (model(x) - y).pow(2).mean()
    return loss * (1e4 if step == 7 else 1.0)  # the injected spike


def test_matches_the_reference_update_on_a_tiny_model_with_a_gradient_spike():
    ours_model, ref_model = _mlp(), _mlp()
    decay = [p for n, p in ours_model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in ours_model.named_parameters() if n.endswith("bias")]
    opt = StableSPAM([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                     lr=1e-2, **HYPER)  # fmt: skip
    ref_params = [p for n, p in ref_model.named_parameters() if n.endswith("weight")]
    ref_params += [p for n, p in ref_model.named_parameters() if n.endswith("bias")]
    wds = [0.1] * len(decay) + [0.0] * len(no_decay)
    state = reference_state(ref_params)
    clip_fractions = []
    for t in range(1, 21):
        lr = 1e-2 * (1 - t / 25)  # a schedule, as the trainer's
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        _loss(ours_model, t).backward()
        opt.step()
        clip_fractions.append(float(opt.last_clip_fraction))
        ref_model.zero_grad()
        _loss(ref_model, t).backward()
        with torch.no_grad():
            reference_step(ref_params, [p.grad for p in ref_params], state, t, [lr] * len(wds), wds, **HYPER)
    assert opt.total_steps == 20 and opt.resets == 4
    assert clip_fractions[6] > 0  # the spike was clipped
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    # not vacuous: plain AdamW on the same data ends elsewhere
    adam_model = _mlp()
    adam = torch.optim.AdamW(adam_model.parameters(), lr=1e-2, weight_decay=0.0)
    for t in range(1, 21):
        adam.zero_grad()
        _loss(adam_model, t).backward()
        adam.step()
    assert (adam_model[0].weight - ours_model[0].weight).abs().max() > 1e-3


def test_the_pure_functions_by_hand():
    grad = torch.tensor([[3.0, -1.0], [0.5, -4.0]])
    clipped, m_max, n = spike_clip(grad, torch.tensor(2.0), step=1, theta=0.5)
    # m_max = 0.5·2 + 0.5·4 = 3, τ = 3 / (1 − 0.5) = 6: nothing above it
    assert float(m_max) == 3.0 and int(n) == 0 and torch.equal(clipped, grad)
    clipped, m_max, n = spike_clip(grad, torch.tensor(0.0), step=2, theta=0.5)
    # m_max = 2, τ = 2 / 0.75 = 8/3: 3 → 3/4·8/3 = 2, −4 → −8/3
    assert int(n) == 2
    torch.testing.assert_close(clipped, torch.tensor([[2.0, -1.0], [0.5, -8.0 / 3.0]]))
    out, m, v = norm_rescale(torch.tensor([3.0, 4.0]), torch.tensor(0.0), torch.tensor(0.0), 1, 0.7, 0.9, 0.0)
    # first step: m̂ = 5, v̂ = 25, so m̂/√v̂ = 1: the gradient is rescaled to unit norm
    torch.testing.assert_close(out, torch.tensor([0.6, 0.8]))
    torch.testing.assert_close((m, v), (torch.tensor(1.5), torch.tensor(2.5)))
    out, _, _ = norm_rescale(torch.tensor([3.0, 4.0]), torch.tensor(1.0), torch.tensor(1.0), 2, 0.5, 0.5, 0.0)
    # m = 0.5 + 2.5 = 3, v = 0.5 + 12.5 = 13; m̂ = 4, v̂ = 52/3: scale 4 / sqrt(52/3) / 5 per unit
    torch.testing.assert_close(out, torch.tensor([3.0, 4.0]) / 5 * 4 / math.sqrt(52 / 3))
    zero, _, _ = norm_rescale(torch.zeros(3), torch.tensor(0.0), torch.tensor(0.0), 1, 0.7, 0.9, 0.0)
    assert torch.equal(zero, torch.zeros(3))  # no 0/0
    assert momentum_scale(5, None, 0.5) == 1.0
    assert momentum_scale(0, 9, 0.5) == 1.0 and momentum_scale(10, 9, 0.5) == pytest.approx(0.5)


def test_state_dict_round_trip_keeps_fp32_statistics_and_the_step_count():
    """A bf16 parameter: torch casts optimizer state to the parameter's dtype on load; the statistics stay fp32, and a
    reloaded optimizer continues exactly like the uninterrupted one."""

    def run(steps, opt=None, param=None):
        if param is None:
            param = torch.nn.Parameter(torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4))
        opt = StableSPAM([param], lr=1e-2, reset_interval=3) if opt is None else opt
        for t in range(steps[0], steps[1]):
            param.grad = (torch.sin(torch.arange(12.0) * t) * (100 if t == 4 else 1)).reshape(3, 4).bfloat16()
            opt.step()
        return param, opt

    full, _ = run((1, 7))
    half, opt = run((1, 4))
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    fresh = torch.nn.Parameter(half.detach().clone())
    reloaded = StableSPAM([fresh], lr=1e-2, reset_interval=3)
    reloaded.load_state_dict(torch.load(buffer, weights_only=True))
    assert reloaded.total_steps == 3 and reloaded.state[fresh]["m_max"].dtype == torch.float32
    assert reloaded.state[fresh]["step"] == 1  # the reset at step 3
    resumed, _ = run((4, 7), reloaded, fresh)
    assert torch.equal(full, resumed)


def test_a_step_without_gradients_is_not_counted():
    p = torch.nn.Parameter(torch.ones(3))
    opt = StableSPAM([p], reset_interval=2)
    opt.step()  # the guard dropped every gradient
    assert opt.total_steps == 0 and not opt.state
    p.grad = torch.ones(3)
    opt.step()
    assert opt.total_steps == 1 and opt.state[p]["step"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gamma1": 1.0}, "`gamma1` must be"),
        ({"theta": -0.1}, "`theta` must be"),
        ({"reset_interval": -1}, "`reset_interval` must be"),
        ({"decay_steps": 0}, "`decay_steps` must be"),
        ({"eta_min": 0.1}, "`eta_min` is the end of the momentum decay"),
    ],
)
def test_options_are_validated_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StableSPAMConfig(**kwargs)
    if "eta_min" not in kwargs:
        with pytest.raises(ValueError, match=match):
            StableSPAM([torch.nn.Parameter(torch.ones(1))], **kwargs)


# -- through the trainers --------------------------------------------------------------------------------------------
CPU = dict(use_cpu=True, bf16=False, report_to="none")
RUN = {**STEP_ARGS, "optim": "adamw_torch", "learning_rate": 1e-3, "logging_steps": 1}


def _sft(tmp_path, steps=3, **config):
    from hf_stable import StableSFTConfig, StableSFTTrainer

    model, tokenizer = build_tiny_model(seed=0)
    args = StableSFTConfig(str(tmp_path), per_device_train_batch_size=4, **{**RUN, "max_steps": steps, **config})
    return StableSFTTrainer(model=model, args=args, train_dataset=dataset_for({}), processing_class=tokenizer)


class _Recorder:
    """Records, at each optimizer step, every parameter's gradient (after the trainer's global clip) and its group's
    learning rate and weight decay."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        groups = getattr(optimizer, "optimizer", optimizer).param_groups
        self.steps.append({id(p): (p.grad.detach().clone(), g["lr"], g["weight_decay"]) for g in groups
                           for p in g["params"] if p.grad is not None})  # fmt: skip

    def __getattr__(self, name):  # every other TrainerCallback event does nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def test_the_trainer_flag_gives_the_reference_update_on_the_trainers_gradients(tmp_path):
    """`stable_spam=True` on a StableSFTTrainer (linear LR decay, weight decay on the decay group, global clip at 1):
    replaying the reference on the gradients the optimizer received gives the trained parameters."""
    hyper = dict(gamma1=0.6, gamma2=0.95, theta=0.99, reset_interval=3, decay_steps=6, eta_min=0.3)
    trainer = _sft(tmp_path, steps=7, stable_spam=True, lr_scheduler_type="linear", weight_decay=0.1,
                   max_grad_norm=1.0, **{f"stable_spam_{k}": v for k, v in hyper.items()})  # fmt: skip
    recorder = _Recorder()
    trainer.add_callback(recorder)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, StableSPAM)
    assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.0, 0.1}
    assert len(recorder.steps) == 7
    state = reference_state(start)
    for t, step in enumerate(recorder.steps, start=1):
        grads = [step[id(p)][0] if id(p) in step else None for p in params]
        lrs = [step[id(p)][1] if id(p) in step else 0.0 for p in params]
        wds = [step[id(p)][2] if id(p) in step else 0.0 for p in params]
        reference_step(start, grads, state, t, lrs, wds, betas=(0.9, 0.999), eps=1e-8, **hyper)
    for p, q in zip(params, start, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-6)
    logged = [log for log in trainer.state.log_history if "stable/spam/clip_fraction" in log]
    assert len(logged) == 7 and logged[-1]["stable/spam/resets"] == 2


def test_each_stable_spam_field_changes_the_update(tmp_path):
    """The switch against AdamW, and every option against its default (a 4-step run; the options that act from the
    second step on, γ₁, θ and the reset, have room to)."""

    def update(name, **config):
        trainer = _sft(tmp_path / name, steps=4, **config)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        return torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before, strict=True)])

    adam = update("adam")
    base = update("spam", stable_spam=True)
    assert not torch.equal(adam, base)
    alternatives = {"gamma1": 0.2, "gamma2": 0.5, "theta": 0.5, "reset_interval": 2, "decay_steps": 3,
                    "eta_min": 0.1}  # fmt: skip
    assert set(alternatives) == {f.name for f in StableSPAMConfig.flags()}
    decayed = update("decayed", stable_spam=True, stable_spam_decay_steps=8)  # eta_min acts only with a decay
    for option, value in alternatives.items():
        reference, extra = (decayed, {"stable_spam_decay_steps": 8}) if option == "eta_min" else (base, {})
        changed = update(option, **{"stable_spam": True, **extra, f"stable_spam_{option}": value})
        assert torch.isfinite(changed).all() and not torch.equal(changed, reference), option


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"stable_spam": True, "optim": "sgd"}, "stable_spam=True cannot be combined with: `optim`='sgd'"),
        ({"stable_spam": True, "optim_args": "x=1"}, "`optim_args` would be ignored"),
        ({"stable_spam_theta": 0.9}, "`stable_spam_theta` is set but `stable_spam` is False"),
        ({"stable_spam": True, "stable_spam_gamma2": 1.0}, "`stable_spam_gamma2` must be"),
        ({"stable_spam": True, "stable_spam_eta_min": 0.2}, "`eta_min` is the end of the momentum decay"),
        ({"stable_spam": "yes"}, "`stable_spam` must be true or false"),
    ],
)
def test_config_refuses_by_name(config, match):
    from hf_stable import StableGRPOConfig, StableSFTConfig

    for config_cls in (StableSFTConfig, StableGRPOConfig):
        with pytest.raises((ValueError, TypeError), match=match):
            config_cls("out", **CPU, **config)


def test_sharded_backends_are_refused_by_name():
    ds = stable_spam_host_problems(SimpleNamespace(optim="adamw_torch", deepspeed={"zero_optimization": {}}))
    fsdp = stable_spam_host_problems(SimpleNamespace(optim="adamw_torch_fused", fsdp=["full_shard"]))
    assert len(ds) == 1 and ds[0].startswith("`deepspeed`") and len(fsdp) == 1 and fsdp[0].startswith("`fsdp`")
    assert stable_spam_host_problems(SimpleNamespace(optim="adamw_torch", fsdp=[], deepspeed=None)) == []


def test_attach_to_a_plain_trl_trainer_and_its_refusals(tmp_path, monkeypatch):
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = build_tiny_model(seed=0)

    def trainer(name, **kwargs):
        args = SFTConfig(str(tmp_path / name), per_device_train_batch_size=4,
                         **{**RUN, "max_steps": 2, **kwargs.pop("args", {})})  # fmt: skip
        return SFTTrainer(model=model, args=args, train_dataset=dataset_for({}), processing_class=tokenizer, **kwargs)

    plain = trainer("plain")
    callback = StableSPAMCallback.attach(plain, reset_interval=7)
    assert plain.optimizer_cls_and_kwargs[0] is StableSPAM
    assert plain.optimizer_cls_and_kwargs[1] == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                 **dataclasses.asdict(StableSPAMConfig(reset_interval=7))}  # fmt: skip
    plain.train()
    assert callback.optimizer is plain.optimizer.optimizer and callback.optimizer.total_steps == 2
    given = trainer("given", optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ValueError, match="the trainer was given one"):
        StableSPAMCallback.attach(given)
    with pytest.raises(ValueError, match="`optim`='adafactor' would be ignored"):
        StableSPAMCallback.attach(trainer("adafactor", args={"optim": "adafactor"}))
    sharded = trainer("fsdp")
    StableSPAMCallback.attach(sharded)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="StableSPAMCallback does not support fsdp"):
        sharded.callback_handler.on_train_begin(sharded.args, sharded.state, sharded.control)


def test_listed_under_stability_optimizer_with_its_paper():
    from hf_stable.papers import PAPERS
    from hf_stable.registry import get_registry, list_methods

    method = get_registry("stability_optimizer").get("stable_spam")
    assert method.fn is StableSPAMCallback and method.paper is PAPERS["stable_spam"]
    out = io.StringIO()
    assert list_methods("stability_optimizer", file=out) == {"stability_optimizer": ["stable_spam"]}
    assert "https://arxiv.org/abs/2502.17055" in out.getvalue()


def test_a_guard_rollback_restores_the_optimizer_step_count(tmp_path):
    """With the guard, a rollback restores Stable-SPAM's state with the snapshot (the step count that schedules the
    resets included), and a step whose gradients the guard dropped is not counted."""
    from hf_stable.callbacks import FaultInjectionCallback, StabilityGuardCallback

    trainer = _sft(tmp_path, steps=8, stable_spam=True, stable_spam_reset_interval=2, stability_guard=True,
                   guard_action="rollback", guard_min_history=2, guard_snapshot_every=2, guard_confirm_steps=1,
                   guard_loss_z=None)  # fmt: skip
    FaultInjectionCallback.attach(trainer, kind="loss_scale", steps=[6], factor=1e4)
    trainer.train()
    (guard,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StabilityGuardCallback)]
    ((step, _, action, restore),) = [(d.step, d.kind, d.action, d.restore_step) for d in guard.decisions]
    assert (step, action) == (6, "rollback")
    # the snapshot holds the state before step `restore`: restore − 1 steps, then steps 7 and 8
    assert trainer.optimizer.optimizer.total_steps == restore - 1 + 2

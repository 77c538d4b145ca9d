"""`loss_mode="ess"` (ESS-adaptive policy loss, P3O arXiv 1905.01756): the pure loss against an independent
computation and a hand gradient, the refusals of every TRL option it does not apply, and the trainer path."""

import math

import pytest
import torch
from grpo_helpers import G, grpo_run
from sft_helpers import assert_same_update

from hf_stable.losses.ess import effective_sample_size, ess_policy_loss, ess_sums, sequence_ess
from hf_stable.losses.policy import LOSS_MODES


CPU = dict(use_cpu=True, bf16=False, report_to="none")


def _batch(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    behavior = logps + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logps + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    is_w = 0.5 + torch.rand(b, t, generator=g, dtype=torch.float64)
    return logps, behavior, ref, mask, adv, is_w


def _by_hand(logps, behavior, ref, mask, adv, is_w, ess, normalizer, beta):
    """Token by token, in Python floats."""
    total = 0.0
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            x, xb, xr = float(logps[i, t]), float(behavior[i, t]), float(ref[i, t])
            w = math.exp(x - xb)
            rho = min(w, ess)
            kl_b = (x - xb) + math.exp(xb - x) - 1
            term = (-rho * float(adv[i]) * x + (1 - ess) * kl_b) * float(is_w[i, t])
            total += term + beta * ((x - xr) + math.exp(xr - x) - 1)
    return total / normalizer


def _ess_by_hand(logps, behavior, mask):
    ws = [math.exp(float(logps[i, t] - behavior[i, t])) for i in range(mask.shape[0]) for t in range(mask.shape[1])
          if mask[i, t]]  # fmt: skip
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def test_ess_values():
    logps, behavior, _, mask, *_ = _batch()
    assert effective_sample_size(ess_sums(logps, behavior, mask)) == pytest.approx(_ess_by_hand(logps, behavior, mask))
    assert effective_sample_size(ess_sums(logps, logps + 0.7, mask)) == pytest.approx(1.0)  # equal ratios
    one = torch.full((1, 4), -60.0, dtype=torch.float64)
    one[0, 2] = 0.0  # a single non-negligible weight
    assert effective_sample_size(ess_sums(one, torch.zeros(1, 4), torch.ones(1, 4))) == pytest.approx(0.25)
    # masked positions change nothing, whatever their log-ratio
    moved = behavior.clone()
    moved[mask == 0] += 100.0
    assert effective_sample_size(ess_sums(logps, moved, mask)) == effective_sample_size(
        ess_sums(logps, behavior, mask)
    )
    assert effective_sample_size(torch.tensor([0.0, 0.0, 0.0])) == 1.0  # no valid token
    assert effective_sample_size(torch.tensor([math.inf, 1.0, 2.0])) == 1.0
    per_seq = sequence_ess(logps, behavior, mask)
    assert per_seq.shape == (3, 1)
    for i in range(3):
        assert per_seq[i, 0] == pytest.approx(_ess_by_hand(logps[i : i + 1], behavior[i : i + 1], mask[i : i + 1]))
    assert sequence_ess(logps, behavior, torch.zeros_like(mask)).eq(1.0).all()


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_loss_matches_a_token_by_token_computation(beta):
    logps, behavior, ref, mask, adv, is_w = _batch()
    ess = _ess_by_hand(logps, behavior, mask)
    loss, metrics = ess_policy_loss(logps, behavior, adv, mask, ess, 7.0, ref, beta, is_w)
    assert loss.item() == pytest.approx(_by_hand(logps, behavior, ref, mask, adv, is_w, ess, 7.0, beta), rel=1e-5)
    w = torch.exp(logps - behavior)[mask > 0]
    assert metrics["capped_frac"].item() == pytest.approx((w > ess).float().mean().item())
    assert metrics["value"].item() == pytest.approx(ess, rel=1e-6)


def test_gradient_matches_the_hand_formula():
    """∂L/∂ℓ = m·[−ρ·A·c + (1 − ESS)·(1 − e^{ℓ_b−ℓ})·c + β(1 − e^{ℓ_ref−ℓ})] / N, c the IS weight; ρ and ESS held
    fixed (detached)."""
    logps, behavior, ref, mask, adv, is_w = _batch(seed=1)
    ess, beta, n = _ess_by_hand(logps, behavior, mask), 0.2, 11.0
    x = logps.clone().requires_grad_(True)
    loss, _ = ess_policy_loss(x, behavior, adv, mask, ess, n, ref, beta, is_w)
    loss.backward()
    rho = torch.exp(logps - behavior).clamp(max=ess)
    hand = (-rho * adv[:, None] + (1 - ess) * (1 - torch.exp(behavior - logps))) * is_w
    hand = (hand + beta * (1 - torch.exp(ref - logps))) * mask / n
    torch.testing.assert_close(x.grad, hand.to(x.grad), rtol=1e-5, atol=1e-7)


def test_on_policy_the_loss_is_reinforce():
    logps, _, _, mask, adv, _ = _batch(seed=2)
    x = logps.clone().requires_grad_(True)
    loss, metrics = ess_policy_loss(x, x.detach(), adv, mask, 1.0, 5.0)
    assert metrics["value"] == 1.0 and metrics["capped_frac"] == 0.0 and metrics["kl_behavior"] == 0.0
    assert loss.item() == pytest.approx((-(adv[:, None] * logps) * mask).sum().item() / 5.0)


def test_the_mode_reads_the_batch_extras():
    """What `LossModeInputsMixin` binds: the reference log-probs (beta), TRL's vLLM IS ratio (behaviour = old), else
    the sampler's log-probs as the behaviour policy."""
    from hf_stable.losses.ess import ESSMode

    logps, behavior, ref, mask, adv, is_w = _batch(seed=3)
    old = behavior + 0.1
    n = 9.0

    def run(inputs, **mode):
        m = ESSMode(**mode)
        m.bind_inputs(inputs)
        return m.loss(logps, mask, adv, old, 1, n, 6)[0].item()

    def pure(beh, **kw):
        ess = effective_sample_size(ess_sums(logps, beh, mask))
        return ess_policy_loss(logps, beh, adv, mask, ess, n, **kw)[0].item()

    assert run({}) == pytest.approx(pure(old))
    assert run({"ref_per_token_logps": ref}, beta=0.3) == pytest.approx(pure(old, ref_per_token_logps=ref, beta=0.3))
    assert run({"sampling_per_token_logps": behavior}) == pytest.approx(pure(behavior))
    both = {"sampling_per_token_logps": behavior, "importance_sampling_ratio": is_w}
    assert run(both) == pytest.approx(pure(old, is_weights=is_w))
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        run({}, beta=0.3)
    weights = torch.exp(logps - old)
    bias = pure(old, ref_per_token_logps=ref, beta=0.3, ref_kl_weights=weights)
    assert run({"ref_per_token_logps": ref}, beta=0.3, bias_correction_kl=True) == pytest.approx(bias)


# -- the config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("loss_type", "grpo"),
        ("epsilon", 0.3),
        ("epsilon_high", 0.28),
        ("delta", 2.0),
        ("importance_sampling_level", "sequence"),
        ("top_entropy_quantile", 0.5),
        ("entropy_coef", 0.01),
        ("use_adaptive_entropy", True),
        ("off_policy_mask_threshold", 0.5),
        ("advantage_estimator", "sgrpo"),
    ],
)
def test_refuses_what_it_does_not_apply_by_name(option, value):
    from hf_stable import StableGRPOConfig

    with pytest.raises(ValueError, match=rf"loss_mode='ess' cannot be combined with: {option}="):
        StableGRPOConfig("out", loss_mode="ess", **CPU, **{option: value})


def test_declared_in_the_loss_mode_registry():
    mode = LOSS_MODES.get("ess")
    assert mode.paper.arxiv == "1905.01756"
    assert [f.name for f in mode.fields] == ["ess_level"]
    assert {"beta", "mask_truncated_completions", "vllm_importance_sampling_correction"} <= set(mode.honours)


# -- the trainer -----------------------------------------------------------------------------------------------------
def _ess_logs(trainer):
    return [h for h in trainer.state.log_history if "stable/ess/value" in h]


def test_on_policy_step_equals_trl_dapo_and_changes_the_parameters(tmp_path):
    trl_update, _ = grpo_run(tmp_path / "dapo")
    ess_update, trainer = grpo_run(tmp_path / "ess", loss_mode="ess")
    assert ess_update.abs().max() > 0
    (log,) = _ess_logs(trainer)
    assert log["stable/ess/value"] == 1.0 and log["stable/ess/capped_frac"] == 0.0
    # the same gradient as GRPO's at ratio 1 (advantages agree up to TRL's roundoff on groups without spread)
    assert_same_update(ess_update, trl_update, rtol=1e-4)


def test_stale_data_caps_the_weights_and_the_fields_act(tmp_path):
    stale = dict(loss_mode="ess", num_iterations=2, max_steps=2, learning_rate=0.5)
    batch, trainer = grpo_run(tmp_path / "batch", **stale)
    second = _ess_logs(trainer)[-1]
    assert second["stable/ess/value"] < 1.0 and second["stable/ess/capped_frac"] > 0
    sequence, _ = grpo_run(tmp_path / "sequence", ess_level="sequence", **stale)
    truncated, _ = grpo_run(tmp_path / "masked", mask_truncated_completions=True, **stale)
    scale, _ = grpo_run(tmp_path / "scale", scale_rewards="none", **stale)
    changed = {"ess_level": sequence, "mask_truncated_completions": truncated, "scale_rewards": scale}
    for name, other in changed.items():
        assert torch.isfinite(other).all() and not torch.equal(batch, other), name


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """ESS is all-reduced over processes: 2 processes x batch G give the update of 1 process x 2G, off-policy."""
    import os

    from launch_helpers import launch_two_processes
    from safetensors.torch import load_file

    script = os.path.join(os.path.dirname(__file__), "ess_ddp_script.py")
    launch_two_processes(script, str(tmp_path), port=29671)
    ddp = load_file(str(tmp_path / "ess_update.safetensors"))
    single, trainer = grpo_run(tmp_path / "single", batch_size=2 * G, **ESS_DDP)
    assert ddp["ess"].item() < 1.0
    assert ddp["ess"].item() == pytest.approx(_ess_logs(trainer)[-1]["stable/ess/value"], rel=1e-5)
    assert_same_update(ddp["update"], single, rtol=1e-5)


ESS_DDP = dict(loss_mode="ess", num_iterations=2, max_steps=2, learning_rate=0.5)

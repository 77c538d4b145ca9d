import math

import pytest
import torch

from hf_stable.stability.clip import (
    adagc_coefficients,
    apply_coefficients,
    clip_coefficients,
    group_norms,
    group_parameters,
)
from hf_stable.stability.degenerate import DegenerateRunMonitor


NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ("param", NAMES),
        ("module", ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                    "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj", "model.norm", "lm_head"]),
        ("layer", ["model.embed_tokens.weight", "layers.0", "layers.1", "model.norm.weight", "lm_head.weight"]),
        ([r"self_attn", r"mlp"], ["model.embed_tokens.weight", "self_attn", "mlp", "model.norm.weight",
                                  "lm_head.weight"]),
    ],
)
def test_grouping(groups, expected):
    assert list(group_parameters([(n, None) for n in NAMES], groups)) == expected


def test_group_norms_and_fixed_clip_against_a_hand_loop():
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)], [torch.randn(2, 2, generator=g) * 10]]
    norms = group_norms(grads)
    for grad_list, norm in zip(grads, norms, strict=True):
        assert float(norm) == pytest.approx(math.sqrt(sum(float(t.pow(2).sum()) for t in grad_list)), rel=1e-6)
    expected = [[t.clone() for t in grp] for grp in grads]
    for grp in expected:  # the authors' loop: torch.nn.utils.clip_grad_norm_ on each group
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grp]
        for p, t in zip(params, grp, strict=True):
            p.grad = t
        torch.nn.utils.clip_grad_norm_(params, 0.5)
    apply_coefficients(grads, clip_coefficients(norms, 0.5))
    for ours, theirs in zip(grads, expected, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a, b, atol=1e-7)


def test_adagc_warmup_is_global_then_per_tensor_against_its_ema():
    norms = torch.tensor([3.0, 4.0])  # global norm 5
    gamma = torch.full((2,), math.inf)
    coef, gamma = adagc_coefficients(norms, gamma, step=1, warmup_steps=1, lambda_abs=1.0)
    assert torch.allclose(coef, torch.tensor([0.2, 0.2]), atol=1e-6)
    assert torch.allclose(gamma, torch.tensor([0.6, 0.8]), atol=1e-6)  # running min of clipped norms
    coef, gamma2 = adagc_coefficients(torch.tensor([0.5, 8.0]), gamma, step=2, warmup_steps=1, lambda_rel=1.05,
                                      beta=0.98)
    # tensor 0 is below 1.05·0.6 -> untouched; tensor 1 is clipped to 1.05·0.8
    assert float(coef[0]) == pytest.approx(1.0)
    assert float(coef[1] * 8.0) == pytest.approx(1.05 * 0.8, rel=1e-5)
    assert float(gamma2[0]) == pytest.approx(0.98 * 0.6 + 0.02 * 0.5, rel=1e-6)
    assert float(gamma2[1]) == pytest.approx(0.98 * 0.8 + 0.02 * 1.05 * 0.8, rel=1e-5)


def _logs(**kw):
    return {"loss": 0.3, "grad_norm": 0.5, **kw}


CFG = {"loss_type": "dapo", "num_iterations": 1, "beta": 0.0, "num_generations": 4, "max_completion_length": 2,
       "mask_truncated_completions": False}


def test_each_condition_fires_once_per_patience_window():
    monitor = DegenerateRunMonitor(patience=3)
    kinds = []
    for _ in range(7):
        kinds += [f.kind for f in monitor.observe(_logs(**{"completions/clipped_ratio": 1.0}), CFG)]
    assert kinds == ["truncated", "truncated"]  # at logs 3 and 6
    monitor.observe(_logs(), CFG)  # a healthy log resets the run
    assert [f.kind for f in monitor.observe(_logs(**{"completions/clipped_ratio": 1.0}), CFG)] == []


def test_messages_say_what_it_means_and_which_knob():
    monitor = DegenerateRunMonitor(patience=1)
    logs = _logs(**{"frac_reward_zero_std": 1.0, "reward_std": 0.0, "rewards/f/std": 0.0, "entropy": 0.001,
                    "kl": 3.0, "completions/clipped_ratio": 1.0})
    found = {f.kind: f.message for f in monitor.observe(logs, CFG)}
    assert set(found) == {"truncated", "zero_std", "constant_reward", "entropy_collapse", "kl_divergence"}
    assert "max_completion_length" in found["truncated"] and "num_generations" in found["zero_std"]
    assert "temperature" in found["entropy_collapse"] and "beta" in found["kl_divergence"]


def test_thresholds_are_fields():
    strict = DegenerateRunMonitor(patience=1, clipped_ratio_min=0.8)
    assert [f.kind for f in strict.observe(_logs(**{"completions/clipped_ratio": 0.85}), CFG)] == ["truncated"]
    assert DegenerateRunMonitor(patience=1).observe(_logs(**{"completions/clipped_ratio": 0.85}), CFG) == []


def test_zero_loss_is_explained_once_at_info_only_where_expected():
    monitor = DegenerateRunMonitor(patience=3)
    grpo = {**CFG, "loss_type": "grpo"}
    first = monitor.observe(_logs(loss=0.0, grad_norm=0.3), grpo)
    assert [(f.level, f.kind) for f in first] == [("info", "zero_loss_expected")]
    assert monitor.observe(_logs(loss=0.0, grad_norm=0.3), grpo) == []
    aligned = {**grpo, "steps_per_generation": 2, "gradient_accumulation_steps": 4, "loss_mode": "ppo"}
    assert [f.kind for f in DegenerateRunMonitor().observe(_logs(loss=0.0, grad_norm=0.3), aligned)] == [
        "zero_loss_expected"]
    for cfg in ({**CFG, "loss_type": "dapo"}, {**grpo, "beta": 0.04}, {**grpo, "num_iterations": 2},
                # a generation batch reused across optimizer steps: TRL keeps old log-probs, the ratio leaves 1
                {**aligned, "steps_per_generation": 8},
                # hf_stable loss modes replace TRL's loss: TRL's explanation does not apply
                {**aligned, "loss_mode": "drpo"}):
        assert DegenerateRunMonitor().observe(_logs(loss=0.0, grad_norm=0.3), cfg) == []


def test_dead_run_and_nonfinite_grad():
    monitor = DegenerateRunMonitor(patience=2)
    kinds = [f.kind for _ in range(2) for f in monitor.observe(_logs(loss=0.0, grad_norm=0.0), CFG)]
    assert kinds == ["dead_run"]
    seen = [[f.kind for f in monitor.observe(_logs(grad_norm=math.nan), CFG)] for _ in range(4)]
    assert seen == [["nonfinite_grad"], [], ["nonfinite_grad"], []]  # on first sight, then once per 2 logs

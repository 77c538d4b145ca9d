"""StableReinforce (arXiv 2505.02835): the pre-clipped PPO surrogate, TRL's normalisers, the k-sigma advantage filter
and the consistency reward, each against a computation written out here by hand (Python floats), and the filter
against the authors' rule as their code states it (`openrlhf/trainer/ppo_utils/replay_buffer.py`, restated below)."""

import asyncio
import math
import statistics

import pytest
import torch

from hf_stable.losses.stable_reinforce import preclip_log_ratio, preclip_ppo_loss, reduce_token_loss, sigma_filter
from hf_stable.rewards import REWARD_FUNCTIONS, StableReinforceReward, consistency_reward
from hf_stable.rewards.resolve import resolve_reward_function


def _ppo_by_hand(d, a, eps_low=0.2, eps_high=0.2, bound=1e3, delta=None):
    """One token: −min(r'·A, clip(r, 1−ε_low, 1+ε_high)·A), r = exp(clamp(d, ±log δ)), r' = min(r, delta)."""
    lim = math.log(bound)
    r = math.exp(min(max(d, -lim), lim))
    r1 = r if delta is None else min(r, delta)
    return -min(r1 * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)


def test_preclip_clamps_the_log_ratio_at_log_delta():
    x = torch.tensor([-20.0, -math.log(1e3), 0.3, 6.0, 9.0])
    lim = math.log(1e3)
    torch.testing.assert_close(preclip_log_ratio(x, 1e3), torch.tensor([-lim, -lim, 0.3, 6.0, lim]))
    with pytest.raises(ValueError, match="bound must be > 1"):
        preclip_log_ratio(x, 1.0)


def test_preclip_ppo_loss_per_token_matches_the_formula_by_hand():
    # log-ratios inside the clip range, beyond it, and beyond the pre-clip bound, on both signs of the advantage
    d = [[0.0, 0.1, -0.3, 8.0], [-9.0, 0.15, 7.5, -0.05]]
    adv = [1.5, -2.0]
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.1, -4.0, -0.7]])
    logps = (old + torch.tensor(d)).requires_grad_(True)
    mask = torch.ones(2, 4)
    per_token, ratio, pre = preclip_ppo_loss(logps, old, torch.tensor(adv), mask, bound=1e3, epsilon_high=0.28)
    want = [[_ppo_by_hand(d[i][t], adv[i], eps_high=0.28) for t in range(4)] for i in range(2)]
    torch.testing.assert_close(per_token, torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert pre.tolist() == [[False, False, False, True], [True, False, True, False]]
    assert ratio[0, 3].item() == pytest.approx(1e3, rel=1e-5)
    # gradient: a pre-clipped token gets none; an unclipped one gets −A·r (d/dℓ of −r·A)
    per_token.sum().backward()
    grad = logps.grad
    assert grad[1, 2] == 0 and grad[0, 3] == 0  # A < 0 with r ≫ 1: plain PPO would push with −A·r ≈ 3616
    assert grad[1, 0] == 0
    assert grad[1, 3].item() == pytest.approx(2.0 * math.exp(-0.05), rel=1e-5)
    assert grad[0, 0].item() == pytest.approx(-1.5, rel=1e-6)
    # without the pre-clip (bound far away) the same token is PPO's: −min(r·A, clip(r)·A) = −r·A for A < 0
    plain, _, _ = preclip_ppo_loss(logps, old, torch.tensor(adv), mask, bound=1e30, epsilon_high=0.28)
    assert plain[1, 2].item() == pytest.approx(2.0 * math.exp(7.5), rel=1e-5)


def test_preclip_ppo_loss_two_sided_and_sequence_level():
    d = torch.tensor([[0.5, 0.7, 9.0], [-0.1, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([-1.0, 2.0])
    # two-sided clipping (TRL's `delta`) caps the unclipped ratio of negative advantages
    per_token, _, _ = preclip_ppo_loss(old + d, old, adv, mask, bound=1e3, delta=1.5)
    want = [[_ppo_by_hand(d[i, t].item(), adv[i].item(), delta=1.5) for t in range(3)] for i in range(2)]
    torch.testing.assert_close(per_token, torch.tensor(want), rtol=1e-6, atol=1e-6)
    # sequence level: one weight per completion, the masked mean of its log-ratios, pre-clipped
    per_seq, ratio, pre = preclip_ppo_loss(old + d, old, adv, mask, bound=1.5, level="sequence")
    means = [(0.5 + 0.7) / 2, (-0.1 + 0.2 + 0.0) / 3]
    want = [[_ppo_by_hand(means[i], adv[i].item(), bound=1.5)] for i in range(2)]
    assert per_seq.shape == (2, 1) and pre.tolist() == [[True], [False]]
    torch.testing.assert_close(per_seq, torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert ratio[0, 0].item() == pytest.approx(1.5, rel=1e-6)


def test_reduce_token_loss_is_trls_normaliser_for_each_loss_type():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    accumulation, step_tokens, max_length = 2.0, 10.0, 4
    want = {
        "grpo": ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2 / accumulation,
        "bnpo": (1 + 2 + 4 + 5 + 6) / 5 / accumulation,
        "dr_grpo": (1 + 2 + 4 + 5 + 6) / (2 * max_length) / accumulation,
        "dapo": (1 + 2 + 4 + 5 + 6) / step_tokens,
    }
    for loss_type, value in want.items():
        got, logged = reduce_token_loss(loss, mask, loss_type, accumulation, step_tokens, max_length)
        assert got.item() == pytest.approx(value), loss_type
        assert logged.item() == pytest.approx(value if loss_type == "dapo" else value * accumulation), loss_type
    with pytest.raises(ValueError, match="loss_type must be one of"):
        reduce_token_loss(loss, mask, "cispo", 1.0, 1.0, 4)
    empty, _ = reduce_token_loss(loss, torch.zeros_like(mask), "dapo", 1.0, 0.0, 4)
    assert empty.item() == 0.0  # no token in the step: a finite 0, not 0/0


# ---------------------------------------------------------------------------------------------------------------------
# the advantage filter


def test_sigma_filter_drops_the_lone_outlier_of_an_imbalanced_batch():
    # the paper's case: one advantage far from a batch of near-equal ones
    a = [1.0] + [0.0] * 19
    mu, sd = statistics.fmean(a), statistics.pstdev(a)  # population std, as the reference code
    got, metrics = sigma_filter(torch.tensor(a), sigma=3.0)
    assert (1.0 - mu) / sd > 3  # the outlier is 4.36 sigma out
    want = [0.0] + [(0.0 - mu) / sd] * 19
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)
    assert metrics["filtered_frac"] == pytest.approx(1 / 20)
    assert metrics["mean"] == pytest.approx(mu) and metrics["std"] == pytest.approx(sd)


def test_sigma_filter_weights_each_completion_by_its_tokens():
    a = [2.0, -1.0, 0.5, 0.0, 3.0]
    n = [3, 1, 0, 2, 4]  # an empty completion has no weight
    total = sum(n)
    mu = sum(w * x for w, x in zip(n, a, strict=True)) / total
    sd = math.sqrt(sum(w * (x - mu) ** 2 for w, x in zip(n, a, strict=True)) / total)
    k = 1.2
    want = [(x - mu) / sd if abs((x - mu) / sd) <= k else 0.0 for x in a]
    got, _ = sigma_filter(torch.tensor(a), torch.tensor(n), sigma=k)
    assert 0 < sum(v == 0.0 for v in want) < len(a)  # k = 1.2 both keeps and drops here
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_sigma_filter_edge_cases():
    # equal advantages (no signal): 0 everywhere, not 0/0
    got, _ = sigma_filter(torch.full((6,), 0.7), torch.ones(6))
    assert torch.equal(got, torch.zeros(6))
    # NaN rows are left out of the statistics and get 0
    a = torch.tensor([1.0, float("nan"), -1.0, 0.0])
    got, _ = sigma_filter(a, torch.tensor([1.0, 5.0, 1.0, 1.0]))
    sd = math.sqrt(2 / 3)
    torch.testing.assert_close(got, torch.tensor([1 / sd, 0.0, -1 / sd, 0.0]))
    # no token at all: one weight per completion
    got, _ = sigma_filter(torch.tensor([1.0, -1.0]), torch.zeros(2))
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="sigma must be > 0"):
        sigma_filter(torch.zeros(2), sigma=0.0)


def _reference_code_filter(a, n):
    """The authors' rule as their `normalize` states it (our restatement): token-weighted mean and variance, the
    variance floored at 1e-8, `Â = (A − μ)·rsqrt + 1e-8`, zero where `Â` is outside `[μ − 3, μ + 3]`, not finite, or
    `|Â| > 10`."""
    total = sum(n)
    mu = sum(w * x for w, x in zip(n, a, strict=True)) / total
    var = sum(w * (x - mu) ** 2 for w, x in zip(n, a, strict=True)) / total
    out = []
    for x in a:
        z = (x - mu) / math.sqrt(max(var, 1e-8)) + 1e-8
        out.append(0.0 if z < mu - 3 or z > mu + 3 or abs(z) > 10 or not math.isfinite(z) else z)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_sigma_filter_agrees_with_the_reference_code_when_the_mean_is_zero(seed):
    """GRPO's advantages have mean 0 per group: there the code's `μ ± 3` window is the paper's `[−3, 3]`."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(12, 8, generator=g, dtype=torch.float64)
    a[0, 0] = 40.0  # an outlier
    a = a - a.mean(1, keepdim=True)  # zero mean per group of 8, so the token-uniform batch mean is 0
    n = [1.0] * a.numel()
    want = _reference_code_filter(a.flatten().tolist(), n)
    got, _ = sigma_filter(a.flatten(), torch.tensor(n), sigma=3.0)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=2e-8)
    assert (got == 0).any()


# ---------------------------------------------------------------------------------------------------------------------
# the consistency reward


def test_consistency_reward_table():
    # (accuracy, consistency, format) -> 0.5·format + accuracy·(1 + 0.5·consistency), by hand
    rows = [
        (1.0, 1.0, 1.0, 2.0),
        (1.0, -1.0, 1.0, 1.0),
        (1.0, 0.0, 0.0, 1.0),
        (0.0, 1.0, 1.0, 0.5),
        (0.0, -1.0, 0.0, 0.0),
        (1.0, float("nan"), float("nan"), 1.0),  # no verdict, no format score: 0 each
    ]
    acc, con, fmt, want = (torch.tensor(col) for col in zip(*rows, strict=True))
    torch.testing.assert_close(consistency_reward(acc, con, fmt), want.double())
    torch.testing.assert_close(
        consistency_reward(acc, con, None, consistency_weight=1.0),
        torch.tensor([2.0, 0.0, 1.0, 0.0, 0.0, 1.0]).double(),
    )
    assert math.isnan(consistency_reward(torch.tensor([float("nan")]), torch.ones(1)).item())


def _accuracy(completions, answer, **kwargs):
    return [None if a is None else float(c.endswith(a)) for c, a in zip(completions, answer, strict=True)]


def _judge(completions, **kwargs):
    return [1 if "so" in c else -1 for c in completions]


def _format(completions, **kwargs):
    return [float(c.startswith("<think>")) for c in completions]


def test_stable_reinforce_reward_combines_its_parts_as_trl_calls_it():
    reward = StableReinforceReward(_accuracy, _judge, _format)
    completions = ["<think>2+2 so</think>4", "<think>no</think>4", "5", "<think>so</think>3"]
    got = reward(prompts=["2+2="] * 4, completions=completions, answer=["4", "4", "4", None], trainer_state=None)
    assert got == [0.5 + 1.5, 0.5 + 0.5, 0.0, None]
    assert reward.__name__ == "stable_reinforce_reward"


def test_stable_reinforce_reward_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="`consistency` must return values in"):
        StableReinforceReward(_accuracy, lambda completions, **kw: [2.0] * len(completions))(
            prompts=["p"], completions=["x"], answer=["x"]
        )
    with pytest.raises(ValueError, match="`accuracy` returned 1 values for 2"):
        StableReinforceReward(lambda **kw: [1.0], _judge)(prompts=["p", "p"], completions=["a", "b"])

    async def judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    with pytest.raises(TypeError, match="`consistency` is async"):
        StableReinforceReward(_accuracy, judge)
    with pytest.raises(TypeError, match="`consistency` must be a reward function"):
        StableReinforceReward(_accuracy, "judge")
    with pytest.raises(ValueError, match="`format_weight` must be a finite number"):
        StableReinforceReward(_accuracy, _judge, format_weight=float("inf"))


def test_the_consistency_reward_is_listed_and_refused_by_name():
    method = REWARD_FUNCTIONS.get("stable_reinforce_reward")
    assert method.fn is StableReinforceReward and method.paper.arxiv == "2505.02835"
    with pytest.raises(ValueError, match="'stable_reinforce_reward' needs a consistency judge"):
        resolve_reward_function("stable_reinforce_reward")


def test_mode_applies_trls_vllm_ratio_and_reference_kl_by_hand():
    """The loss mode's micro-batch loss with TRL's vLLM ratio and a bias-corrected k3 KL (`beta`), token by token:
    `Σ_t m·(is·ppo + β·r·kl) / step_tokens` (TRL multiplies the ratio before adding the KL)."""
    from hf_stable.losses.stable_reinforce import StableReinforceMode

    d = [[0.1, 8.0, -0.2], [0.0, -0.4, 0.3]]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.9]])
    logps = old + torch.tensor(d)
    ref = torch.tensor([[-1.2, -1.5, -0.4], [-0.1, -1.0, -1.0]])
    is_w = torch.tensor([[0.9, 1.1, 1.0], [1.2, 0.8, 0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, beta, step_tokens = [-1.0, 0.5], 0.04, 7.0
    mode = StableReinforceMode(bound=1e3, beta=beta, bias_correction_kl=True, loss_type="dapo")
    mode.bind_inputs({"importance_sampling_ratio": is_w, "ref_per_token_logps": ref})
    loss, policy, parts = mode.loss(logps, mask, torch.tensor(adv), old, 1.0, step_tokens, 3)
    total = 0.0
    for i in range(2):
        for t in range(3):
            if mask[i, t] == 0:
                continue
            r = math.exp(min(max(d[i][t], -math.log(1e3)), math.log(1e3)))
            x, xr = logps[i, t].item(), ref[i, t].item()
            kl = math.exp(xr - x) - (xr - x) - 1
            total += is_w[i, t].item() * _ppo_by_hand(d[i][t], adv[i]) + beta * r * kl
    assert loss.item() == pytest.approx(total / step_tokens, rel=1e-6)
    assert policy.item() == loss.item()  # dapo: TRL logs the loss itself
    assert parts["preclipped_frac"].item() == pytest.approx(1 / 5)

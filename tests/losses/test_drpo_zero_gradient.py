"""Why DRPO gives a gradient of exactly 0 with a reward of 1 for "the completion contains a digit": DRPO's
coefficients are non-zero only in groups that hold both a correct completion (reward above `success_threshold` *and*
ended on EOS) and an incorrect one. A group where every completion contains a digit has no negative; a group where
the completions are cut at `max_completion_length` (a small random model rarely samples EOS within a short budget)
has no positive. Either way `c_i = 0` for every sample and `∇loss = -(1/N) Σ_i G·c_i ∇s(o_i) = 0` exactly (the KL
hinge is 0 on an on-policy step). See docs/grpo.md ("When DRPO's gradient is exactly zero")."""

import pytest
import torch

from hf_stable.losses.policy import LOSS_MODES


G, T, L_MAX = 4, 5, 5


def _gradient(contains_digit, ended_on_eos, lengths):
    """The gradient of one on-policy DRPO step w.r.t. the log-prob logits of 2 groups of G completions."""
    mode = LOSS_MODES.get("drpo")(neg_weighting="uniform")
    rewards = torch.tensor(contains_digit, dtype=torch.float32).unsqueeze(1)  # (N, 1): the digit reward
    lengths = torch.tensor(lengths, dtype=torch.float32)
    advantages, _, _ = mode.advantages(
        rewards, torch.ones(1), torch.tensor(ended_on_eos), lengths, G, L_MAX
    )
    logits = torch.randn(2 * G, T, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    logps = torch.log_softmax(logits, -1)[..., 0]  # (N, T) log π of the sampled tokens
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    loss, _, _ = mode.loss(logps, mask, advantages, None, 1, mask.sum(), L_MAX)
    (grad,) = torch.autograd.grad(loss, logits)
    return advantages, grad


@pytest.mark.parametrize(
    ("case", "contains_digit", "ended_on_eos"),
    [
        ("every completion has a digit", [1] * 8, [True] * 8),
        ("all cut at the length budget", [1, 0, 1, 1, 0, 1, 0, 0], [False] * 8),
        ("the digits only in cut completions", [1, 0, 1, 0, 1, 0, 1, 0], [False, True] * 4),
    ],
)
def test_no_group_with_a_correct_and_an_incorrect_completion_gives_zero(case, contains_digit, ended_on_eos):
    advantages, grad = _gradient(contains_digit, ended_on_eos, [5, 3, 5, 4, 5, 2, 5, 5])
    assert torch.equal(advantages, torch.zeros(2 * G)), case
    assert torch.equal(grad, torch.zeros_like(grad)), case


def test_one_group_with_a_contrast_gives_a_gradient():
    """The control: one complete completion with a digit and one without, in the first group, move the policy."""
    contains_digit = [1, 0, 1, 1, 1, 1, 1, 1]
    ended_on_eos = [True, True, False, False, True, True, True, True]
    advantages, grad = _gradient(contains_digit, ended_on_eos, [3, 4, 5, 5, 2, 3, 4, 4])
    # group 1: one positive (weight 1, times G), the negatives are the no-digit one and the two cut ones (1/3 each)
    torch.testing.assert_close(advantages[:G], torch.tensor([G, -G / 3, -G / 3, -G / 3]))
    assert torch.equal(advantages[G:], torch.zeros(G))  # group 2: all correct, no contrast
    assert grad[:G].abs().sum() > 0 and torch.equal(grad[G:], torch.zeros_like(grad[G:]))

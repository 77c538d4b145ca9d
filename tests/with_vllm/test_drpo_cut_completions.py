"""Why DRPO trains nothing when every completion is cut at the length budget (with or without vLLM; no vLLM needed).

Observed: a random tiny model, a reward of 1 for "the completion contains a digit", `loss_mode="drpo"`: the gradient is
exactly 0 at every step. DRPO (arXiv 2510.04474) weighs completion i of a group by

    c_i = softmax_{j in P}((1 - L_j/L_max)/λ)_i  for i in P,   c_i = -softmax_{j in N}(s_old(o_j)/τ)_i  for i in N,

and c = 0 in a group without both a positive and a negative; the loss is `-mean_i G·c_i s(o_i)` plus the KL hinge
`[max(β(KL - δ), 0)]_sg · KL`. A completion cut at `max_completion_length` counts as incorrect, whatever its reward.
A random model almost never samples eos within 6 tokens, so every completion is cut, every group has only negatives,
every c_i is 0, and on-policy (π_old = π) KL = 0 and the hinge is 0 too: the gradient is 0 by the method's math, not by
a defect. tests/with_vllm/conftest.py builds a model that ends about half of its completions for that reason.
"""

import torch

from hf_stable.losses.policy import DRPOMode, drpo_loss


G = 4


def _gradient(complete):
    torch.manual_seed(0)
    n = 2 * G
    rewards = torch.ones(n, 1)  # every completion contains a digit
    rewards[1::2] = 0.0  # ... or not: each group has rewards 1 and 0
    lengths = torch.full((n,), 6.0)
    lengths[complete] = 3.0
    mode = DRPOMode(correctness_index=0)
    logits = torch.randn(n, 6, 10, requires_grad=True)
    per_token_logps = torch.log_softmax(logits, -1)[..., 0]
    mask = torch.ones(n, 6)
    seq_old = (per_token_logps.detach() * mask).sum(-1)
    advantages, _, _ = mode.advantages(rewards, torch.ones(1), complete, lengths, G, 6, seq_old)
    loss, _ = drpo_loss(per_token_logps, mask, advantages, per_token_logps.detach())
    loss.backward()
    return advantages, logits.grad


def test_drpo_gradient_is_zero_when_every_completion_is_cut():
    advantages, grad = _gradient(torch.zeros(2 * G, dtype=torch.bool))
    assert torch.equal(advantages, torch.zeros(2 * G))
    assert torch.equal(grad, torch.zeros_like(grad))


def test_drpo_gradient_is_not_zero_once_a_rewarded_completion_ends():
    complete = torch.zeros(2 * G, dtype=torch.bool)
    complete[0] = True  # the first group's first completion (reward 1) ends with eos
    advantages, grad = _gradient(complete)
    assert advantages[0] > 0 and (advantages[1:G] < 0).all() and torch.equal(advantages[G:], torch.zeros(G))
    assert grad[:G].abs().sum() > 0 and torch.equal(grad[G:], torch.zeros_like(grad[G:]))

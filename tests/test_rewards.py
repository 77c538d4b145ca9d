"""Tests of the reward functions in `hf_stable.rewards`: stable rank (SR-GRPO), synthetic reward noise and the
majority-vote pseudo-label reward.

Expected values are independent of the implementation: constructed matrices of known rank, `torch.linalg.svdvals`
in float64, a separate unpadded forward of the tiny model, binomial bounds on flip counts, and hand-worked groups.
Papers: SR-GRPO (arXiv 2512.02807), S-GRPO's reward-flip model (arXiv 2508.05928).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.rewards import (
    REWARD_FUNCTIONS,
    MajorityVoteReward,
    StableRankReward,
    arithmetic_reward,
    majority_vote_reward,
    noisy_reward,
    stable_rank,
)
from hf_stable.testing import build_tiny_model


HYPOTHESIS = settings(max_examples=50, deadline=None)


def test_reward_registry():
    assert REWARD_FUNCTIONS.get("arithmetic_exact_match").fn is arithmetic_reward


# =====================================================================================================================
# stable_rank


def _svd_stable_rank(h: torch.Tensor) -> float:
    s = torch.linalg.svdvals(h.double())
    return float((s**2).sum() / s[0] ** 2)


@pytest.mark.parametrize(("t", "d"), [(5, 16), (16, 5), (7, 7), (1, 8)])
def test_stable_rank_of_rank_one_is_one(t, d):
    gen = torch.Generator().manual_seed(t * d)
    h = torch.randn(t, 1, generator=gen) @ torch.randn(1, d, generator=gen)
    assert stable_rank(h).item() == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize(("t", "d"), [(4, 16), (16, 16), (16, 4), (3, 64)])
def test_stable_rank_of_orthonormal_rows_or_columns_is_min_t_d(t, d):
    gen = torch.Generator().manual_seed(t + d)
    q, _ = torch.linalg.qr(torch.randn(max(t, d), min(t, d), generator=gen, dtype=torch.float64))
    h = q.T if t < d else q  # orthonormal rows (T ≤ d) or orthonormal columns (T > d)
    assert h.shape == (t, d)
    assert stable_rank(h.float()).item() == pytest.approx(min(t, d), rel=1e-4)
    assert stable_rank(3.7 * h.float()).item() == pytest.approx(min(t, d), rel=1e-4)  # scale-free


@HYPOTHESIS
@given(t=st.integers(1, 24), d=st.integers(1, 24), seed=st.integers(0, 10_000), center=st.booleans())
def test_stable_rank_matches_svd(t, d, seed, center):
    gen = torch.Generator().manual_seed(seed)
    # anisotropic columns so that σ_max is well separated
    h = torch.randn(t, d, generator=gen) * torch.linspace(0.2, 3.0, d)
    ref_input = h - h.mean(0, keepdim=True) if center else h
    sr = stable_rank(h, center=center).item()
    if torch.linalg.svdvals(ref_input.double())[0] ** 2 <= 1e-10:
        assert sr == 0.0
    else:
        assert sr == pytest.approx(_svd_stable_rank(ref_input), rel=1e-4)
        assert 1.0 - 1e-4 <= sr <= min(t, d) + 1e-4


def test_stable_rank_batch_and_zero_matrix():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 6, 10, generator=gen)
    sr = stable_rank(h)
    assert sr.shape == (3,)
    np.testing.assert_allclose(sr.numpy(), [_svd_stable_rank(x) for x in h], rtol=1e-4)
    assert stable_rank(torch.zeros(4, 8)).item() == 0.0
    bf16 = stable_rank(h[0].bfloat16())
    assert bf16.dtype == torch.float32
    assert bf16.item() == pytest.approx(_svd_stable_rank(h[0].bfloat16().float()), rel=1e-3)


# =====================================================================================================================
# StableRankReward on the tiny model


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model(seed=0)
    return model, tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _reference_sr(model, prompt_ids: list[int], completion_ids: list[int], after_norm: bool = False) -> float:
    """An unpadded forward of prompt + completion alone; SR by SVD of the completion's hidden states of the last
    layer, before the final norm (its input) by default, after it (`hidden_states[-1]`) with ``after_norm``."""
    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids + completion_ids]), output_hidden_states=True)
    hook.remove()
    h = (out.hidden_states[-1] if after_norm else captured[0])[0, len(prompt_ids) :]
    return _svd_stable_rank(h)


def test_stable_rank_reward_scores_repetition_lower(tiny):
    model, tok = tiny
    reward = StableRankReward(model, tok)
    repeated = _ids(tok, "3" * 16)
    varied = _ids(tok, "3+4*5=23; ok then")[:16]
    assert len(repeated) == len(varied) == 16
    scores = reward(
        prompts=["1+2=", "1+2="], completions=["3" * 16, "3+4*5=23; ok th"], completion_ids=[repeated, varied]
    )
    assert scores[0] < scores[1]
    assert scores[0] < 1.5 < scores[1]
    assert 1.0 - 1e-4 <= scores[0] and scores[1] <= 16 + 1e-4


def test_stable_rank_reward_matches_unpadded_reference_and_handles_empty(tiny):
    """A padded batch of different lengths gives each completion the SR of its own unpadded forward; an empty
    completion gives None (TRL's "not applicable")."""
    model, tok = tiny
    model.train()
    reward = StableRankReward(model, tok, batch_size=3)
    prompts = ["1+2=", "7*8=", "12-5=", "9+9="]
    completions = ["3", "56 and more text", "", "18!"]
    ids = [_ids(tok, c) for c in completions]
    scores = reward(prompts=prompts, completions=completions, completion_ids=ids)
    assert scores[2] is None
    assert model.training  # restored
    model.eval()
    for i in (0, 1, 3):
        assert scores[i] == pytest.approx(_reference_sr(model, _ids(tok, prompts[i]), ids[i]), rel=1e-3)
    assert scores[0] == pytest.approx(1.0, rel=1e-5)  # a single token: rank one
    # completion_ids omitted: re-tokenised from the text
    again = reward(prompts=prompts, completions=completions)
    assert again[2] is None
    np.testing.assert_allclose([again[i] for i in (0, 1, 3)], [scores[i] for i in (0, 1, 3)], rtol=1e-5)


def test_stable_rank_reward_normalisations_and_chat_prompts(tiny):
    model, tok = tiny
    ids = [_ids(tok, "56 and more")]
    raw = StableRankReward(model, tok)(prompts=["7*8="], completions=[None], completion_ids=ids)[0]
    by_t = StableRankReward(model, tok, normalize="by_T")(prompts=["7*8="], completions=[None], completion_ids=ids)[0]
    log = StableRankReward(model, tok, normalize="log")(prompts=["7*8="], completions=[None], completion_ids=ids)[0]
    assert by_t == pytest.approx(raw / len(ids[0]), rel=1e-6)  # T = 11 < d = 64
    assert log == pytest.approx(math.log(raw), rel=1e-6)
    # conversational prompt: the chat template's generation prompt precedes the completion
    chat = [{"role": "user", "content": "7*8="}]
    prompt_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    score = StableRankReward(model, tok)(prompts=[chat], completions=[None], completion_ids=ids)[0]
    assert score == pytest.approx(_reference_sr(model, list(prompt_ids), ids[0]), rel=1e-3)
    with pytest.raises(ValueError, match="normalize"):
        StableRankReward(model, tok, normalize="sqrt")
    # after the final norm: what the LM head sees, a different reading
    after = StableRankReward(model, tok, hidden="after_norm")(prompts=["7*8="], completions=[None], completion_ids=ids)
    assert after[0] == pytest.approx(_reference_sr(model, _ids(tok, "7*8="), ids[0], after_norm=True), rel=1e-3)
    assert after[0] != pytest.approx(raw, rel=1e-3)


def test_stable_rank_reward_is_a_plain_callable(tiny):
    model, tok = tiny
    reward = StableRankReward(model, tok)
    assert not isinstance(reward, torch.nn.Module)
    assert callable(reward) and reward.__name__ == "stable_rank"


# =====================================================================================================================
# noisy_reward


def _ones_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_noisy_reward_flip_rate_is_binomial():
    p, n = 0.2, 20_000
    wrapped = noisy_reward(_ones_reward, p, seed=3)
    flips = sum(1 for _ in range(20) for r in wrapped(completions=[None] * (n // 20)) if r == 0.0)
    # 6 standard deviations of Binomial(n, p)
    assert abs(flips - n * p) <= 6 * math.sqrt(n * p * (1 - p))


def test_noisy_reward_deterministic_for_a_seed_and_leaves_global_rng():
    clean = [1.0, 0.0, None, 1.0, 0.0] * 40
    state = random.getstate()
    a = noisy_reward(lambda completions, **kw: clean, 0.3, seed=7)
    b = noisy_reward(lambda completions, **kw: clean, 0.3, seed=7)
    c = noisy_reward(lambda completions, **kw: clean, 0.3, seed=8)
    out_a = [a(completions=clean) for _ in range(3)]
    out_b = [b(completions=clean) for _ in range(3)]
    assert out_a == out_b
    assert out_a[0] != out_a[1]  # the RNG advances between calls
    assert c(completions=clean) != out_a[0]
    assert random.getstate() == state
    for out in out_a:
        assert all((r is None) == (x is None) for r, x in zip(out, clean, strict=True))  # None passes through
        assert all(r in (0.0, 1.0) for r in out if r is not None)


def test_noisy_reward_zero_and_one_flip_probability():
    clean = [1.0, 0.0, None, 1.0]
    assert noisy_reward(lambda completions, **kw: clean, 0.0)(completions=clean) == clean
    assert noisy_reward(lambda completions, **kw: clean, 1.0)(completions=clean) == [0.0, 1.0, None, 0.0]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="flip_prob"):
            noisy_reward(_ones_reward, bad)


def test_noisy_reward_logs_clean_mean():
    logged = []
    clean = [1.0, 0.0, None, 1.0, 1.0]

    def verifier(completions, **kwargs):
        return clean

    wrapped = noisy_reward(verifier, 0.5, seed=0)
    assert wrapped.__name__ == "verifier"
    wrapped(completions=clean, log_metric=lambda name, value: logged.append((name, value)))
    assert logged == [("verifier/clean", pytest.approx(3 / 4))]
    named = noisy_reward(verifier, 0.5, name="acc")
    named(completions=clean, log_metric=lambda name, value: logged.append((name, value)))
    assert logged[-1] == ("acc/clean", pytest.approx(3 / 4))
    # no hook: nothing breaks
    assert len(wrapped(completions=clean)) == len(clean)


# =====================================================================================================================
# majority_vote_reward


def test_majority_vote_hand_examples():
    # group 1: "a" is the majority; group 2: a 2-2 tie goes to the first seen ("x"), stripped text compared
    completions = ["a", "b", "a", "c", " x", "y", "y ", "x"]
    assert majority_vote_reward(completions, 4) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    # empty answers never count as the majority, even when most common
    assert majority_vote_reward(["", "", " ", "7"], 4) == [0.0, 0.0, 0.0, 1.0]
    assert majority_vote_reward(["", "  ", ""], 3) == [0.0, 0.0, 0.0]
    # a three-way tie: the first seen wins
    assert majority_vote_reward(["5", "6", "7"], 3) == [1.0, 0.0, 0.0]


def test_majority_vote_chat_messages_extract_and_class():
    completions = [
        [{"role": "assistant", "content": "The answer is 4"}],
        [{"role": "assistant", "content": "so 5"}],
        [{"role": "assistant", "content": "it is 4"}],
        [],
    ]

    def last_word(text):
        return text.split()[-1] if text.split() else ""

    assert majority_vote_reward(completions, 4, extract=last_word) == [1.0, 0.0, 1.0, 0.0]
    reward = MajorityVoteReward(2, extract=last_word)
    assert reward.__name__ == "majority_vote"
    # groups ["4", "5"] (tie: first seen) and ["4", ""] (empty never wins)
    assert reward(completions=completions, prompts=["p"] * 4) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="groups"):
        majority_vote_reward(["a", "b", "c"], 2)

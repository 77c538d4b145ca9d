"""MMC: a sequential certificate that the majority answer is the mode of a model's answer distribution
(Martingale Majority Certificate, Cordero-Encinar & Duncan, *Certified Self-Consistency: Statistical Guarantees and
Test-Time Training for Reliable Reasoning in LLMs*, arXiv 2510.17472; docs/evaluation.md, "MMC").

Draw answers X_1, X_2, ... i.i.d. from the model (any hashable labels, the answer set need not be known) and stop at
the first n where the evidence that the current leader is the unique mode reaches 1/α, or at `max_samples`. The
guarantee: for every answer distribution p, P(the rule ever certifies an answer that is not the unique mode of p) ≤ α,
under any stopping (Ville's inequality); with a tie at the top every certificate is an error, so a tie is certified
with probability ≤ α.

Reconstructed: the paper's abstract names the rule (an anytime-valid stopping rule on the majority) but not its
statistic, and its text and code were not read here (a third-party page describes it as e-processes on the margin
between the leader and the runner-up, which is what this is). The statistic and its validity argument are ours:

* Pairwise e-process. On the samples that equal a or b, 1{X = a} is Bernoulli(θ0) with θ0 = p_a / (p_a + p_b), and
  "a is not above b" is θ0 ≤ 1/2. With k samples equal to a and l equal to b, the mixture over θ ~ Uniform[1/2, 1] of
  the likelihood ratios against θ = 1/2 is

      M(k, l) = 2^(k+l) ∫_{1/2}^{1} θ^k (1 − θ)^l · 2 dθ = Σ_{j=0..k} C(k+l+1, j) / ((k+l+1) · C(k+l, k)),

  (the integral is B(k+1, l+1) P(Binomial(k+l+1, ½) ≤ k)). Each θ ≥ 1/2 gives a factor 2θ (an a), 2(1 − θ) (a b), or
  1 (anything else) with conditional mean 1 + (2θ − 1)(p_a − p_b) ≤ 1 when p_a ≤ p_b, so M is a nonnegative
  supermartingale with M(0, 0) = 1 under that null; M grows with k and shrinks with l.
* The data-dependent leader. The answer to certify is chosen by the data, so one fixed pair is not enough. Each answer
  a is indexed by the data-independent position s_a at which it first appears, and it only uses the samples after
  s_a (the window (s_a, n]). Its e-value is

      E_a(n) = w(s_a) · M(k_a, l_a),   w(s) = 1 / (s (s + 1))  (Σ_s w(s) = 1),

  with k_a the window count of a and l_a the largest window count of any other answer (the runner-up in the window;
  unseen answers count 0). Validity: fix a mode m of p and, for every answer a that is not the unique mode, a rival
  b(a) with p_b(a) ≥ p_a (m, or the other top answer when a ties with m). Then E_a(n) ≤ w(s_a) M(k_a, count of b(a)),
  and Z_n = Σ_{s ≤ n} w(s) 1{X_s new and not the unique mode} M^(s)_n + Σ_{s > n} w(s) is a nonnegative
  supermartingale with Z_0 = 1: each term starts at 1 at its (data-independent) index s, the label it tests is fixed
  given the past, and its factors have mean ≤ 1. Every wrong certificate implies Z_n ≥ 1/α, which Ville's inequality
  bounds by α, simultaneously for all n, all answers and any stopping rule.
* Stopping: at the first n with max_a E_a(n) ≥ 1/α (the maximiser is the certified answer; it is the window leader),
  or at `max_samples` without a certificate. The weights cost log(s (s + 1)) nats for an answer first seen at s, and
  the first sample of every answer is not counted for it: the price of certifying a data-chosen answer without
  knowing the answer set. The reported `p_value` = min(1, 1 / max over time of the e-value) is anytime-valid.

The abstract's "post-training objectives that optimise sharpness against bias" are not implemented (no formula is
given; docs/paper_index.md). Statistics in float64; the answer draws are the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..papers import Paper


# kept beside the code (not in `hf_stable.papers`) so that the paper table other modules load stays unchanged
MMC_PAPER = Paper(
    "mmc",
    "Certified Self-Consistency: Statistical Guarantees and Test-Time Training for Reliable Reasoning in LLMs",
    "Paula Cordero-Encinar and Andrew B. Duncan",
    "2510.17472",
    2025,
    "@misc{mmc2025,\n"
    "  title         = {Certified Self-Consistency: Statistical Guarantees and Test-Time Training for Reliable "
    "Reasoning in LLMs},\n"
    "  author        = {Cordero-Encinar, Paula and Duncan, Andrew B.},\n"
    "  year          = {2025},\n  eprint        = {2510.17472},\n  archivePrefix = {arXiv}\n}",
)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
    return value


@lru_cache(maxsize=65536)
def _log_mixture(k: int, m: int) -> float:
    n = k + m + 1
    terms = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) for j in range(k + 1)]
    top = max(terms)
    log_sum = top + math.log(sum(math.exp(t - top) for t in terms))
    log_norm = math.log(n) + math.lgamma(k + m + 1) - math.lgamma(k + 1) - math.lgamma(m + 1)
    return log_sum - log_norm


def log_pair_evalue(wins: int, losses: int) -> float:
    """log M(k, l): the log of the Uniform[1/2, 1]-mixture e-value that an answer beats one rival.

    Args:
        wins: k ≥ 0, samples equal to the answer.
        losses: l ≥ 0, samples equal to the rival.

    Returns:
        float64 log of `Σ_{j=0..k} C(k+l+1, j) / ((k+l+1) C(k+l, k))`; 0 at (0, 0).
    """
    return _log_mixture(_check_count("wins", wins), _check_count("losses", losses))


def log_pair_evalues(wins, losses) -> torch.Tensor:
    """[`log_pair_evalue`] elementwise: `wins`, `losses` integer tensors of one shape `[...]` → `[...]` float64."""
    k, m = torch.as_tensor(wins), torch.as_tensor(losses)
    if k.is_floating_point() or m.is_floating_point() or k.shape != m.shape:
        raise ValueError(
            f"`wins` and `losses` must be integer tensors of one shape, got {k.dtype}{tuple(k.shape)} and "
            f"{m.dtype}{tuple(m.shape)}."
        )
    pairs = zip(k.reshape(-1).tolist(), m.reshape(-1).tolist(), strict=True)
    flat = [log_pair_evalue(int(a), int(b)) for a, b in pairs]
    return torch.tensor(flat, dtype=torch.float64).reshape(k.shape)


def first_seen_weight(index: int) -> float:
    """w(s) = 1 / (s (s + 1)) for the 1-based sample index s at which an answer first appears (Σ_s w(s) = 1)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 1:
        raise ValueError(f"`index` must be an integer >= 1 (1-based sample index), got {index!r}.")
    return 1.0 / (index * (index + 1))


def check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"`alpha` must be a number in (0, 1), got {alpha!r}.")
    return float(alpha)


class MMCState:
    """The certificate's running state over a stream of answers (O(number of distinct answers) per answer).

    `update(answer)` adds one draw and returns the log e-value of that answer (the only one whose e-value can rise);
    `log_evalues()` gives every seen answer's log E_a(n) (module docstring), `best()` the largest.
    """

    def __init__(self):
        self.n = 0
        self.counts: dict[Hashable, int] = {}
        self._first: dict[Hashable, int] = {}  # answer -> s_a
        self._base: dict[Hashable, dict[Hashable, int]] = {}  # answer -> counts at s_a (X_{s_a} included)
        self._rival: dict[Hashable, int] = {}  # answer -> l_a, the runner-up's window count

    def _window(self, a: Hashable, b: Hashable) -> int:
        return self.counts.get(b, 0) - self._base[a].get(b, 0)

    def update(self, answer: Hashable) -> float:
        try:
            hash(answer)
        except TypeError:
            raise TypeError(f"answers must be hashable, got {type(answer).__name__}.") from None
        self.n += 1
        self.counts[answer] = self.counts.get(answer, 0) + 1
        if answer not in self._first:
            self._first[answer] = self.n
            self._base[answer] = dict(self.counts)
            self._rival[answer] = 0
        for a in self._first:
            if a != answer:  # counts only rise, so the window maximum changes only through this answer
                self._rival[a] = max(self._rival[a], self._window(a, answer))
        return self.log_evalue(answer)

    def log_evalue(self, answer: Hashable) -> float:
        """log E_a(n) = log w(s_a) + log M(k_a, l_a); −inf for an answer not seen yet."""
        if answer not in self._first:
            return -math.inf
        k = self._window(answer, answer)
        return math.log(first_seen_weight(self._first[answer])) + _log_mixture(k, self._rival[answer])

    def log_evalues(self) -> dict[Hashable, float]:
        return {a: self.log_evalue(a) for a in self._first}

    def best(self) -> tuple[Hashable | None, float]:
        """(answer, log e-value) of the largest e-value; (None, −inf) before the first answer."""
        values = self.log_evalues()
        if not values:
            return None, -math.inf
        a = max(values, key=lambda x: (values[x], self.counts[x]))
        return a, values[a]

    def majority(self) -> Hashable | None:
        """The most common answer so far (ties: the first seen)."""
        if not self.counts:
            return None
        return max(self.counts, key=lambda a: (self.counts[a], -self._first[a]))


def mmc_log_evalues(answers: Iterable[Hashable]) -> dict[Hashable, float]:
    """Every answer's log E_a(n) after the whole sequence `answers` (length n); see the module docstring."""
    state = MMCState()
    for a in answers:
        state.update(a)
    return state.log_evalues()


@dataclass(frozen=True)
class Certificate:
    """The outcome of [`certify_majority`].

    Args:
        answer: the certified answer, or None when `max_samples` ran out first.
        certified: whether E_answer(n) reached 1/α.
        num_samples: n, answers drawn.
        e_value: the largest e-value at the stop (≥ 1/α when certified).
        p_value: min(1, 1 / its running maximum over n): anytime-valid, ≤ α when certified.
        majority: the most common answer at the stop (ties: the first seen), certified or not.
        counts: answer → count over the n draws.
        alpha: the level.
    """

    answer: Hashable | None
    certified: bool
    num_samples: int
    e_value: float
    p_value: float
    majority: Hashable | None
    counts: dict = field(default_factory=dict)
    alpha: float = 0.05


def _check_budget(max_samples) -> int:
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
        raise ValueError(f"`max_samples` must be an integer >= 1, got {max_samples!r}.")
    return max_samples


def certify_stream(answers: Iterable[Hashable], alpha: float = 0.05, max_samples: int = 256) -> Certificate:
    """Run the certificate over the answers of an iterable (stops early; at most `max_samples` are read)."""
    alpha, max_samples = check_alpha(alpha), _check_budget(max_samples)
    threshold = -math.log(alpha)
    state, best_log = MMCState(), -math.inf
    for answer in answers:
        log_e = state.update(answer)
        best_log = max(best_log, log_e)
        if log_e >= threshold:
            return _certificate(state, answer, True, log_e, best_log, alpha)
        if state.n >= max_samples:
            break
    _, log_e = state.best()
    return _certificate(state, None, False, log_e, best_log, alpha)


def _certificate(state: MMCState, answer, certified: bool, log_e: float, best_log: float, alpha: float):
    return Certificate(
        answer=answer,
        certified=certified,
        num_samples=state.n,
        e_value=math.exp(log_e) if log_e > -math.inf else 0.0,
        p_value=min(1.0, math.exp(-best_log)) if best_log > -math.inf else 1.0,
        majority=state.majority(),
        counts=dict(state.counts),
        alpha=alpha,
    )


def certify_majority(
    sample_answer: Callable[[], Hashable], alpha: float = 0.05, max_samples: int = 256
) -> Certificate:
    """Draw answers with `sample_answer()` until the Martingale Majority Certificate holds or the budget runs out.

    Args:
        sample_answer: returns one answer per call (a hashable label, e.g. the extracted final answer), each call an
            independent draw from the same distribution.
        alpha: the level in (0, 1): P(certifying an answer that is not the unique mode) ≤ alpha.
        max_samples: the budget, an integer ≥ 1.

    Returns:
        A [`Certificate`]: the certified answer (or None), the draws used, the e-value and anytime-valid p-value.
    """
    if not callable(sample_answer):
        raise TypeError(f"`sample_answer` must be callable, got {type(sample_answer).__name__}.")
    alpha, max_samples = check_alpha(alpha), _check_budget(max_samples)
    return certify_stream((sample_answer() for _ in range(max_samples)), alpha, max_samples)


def certify_model_answer(
    model,
    tokenizer,
    prompt,
    *,
    extract: Callable[[str], Hashable] | None = None,
    alpha: float = 0.05,
    max_samples: int = 64,
    batch_size: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Certificate:
    """[`certify_majority`] on a transformers model: completions of `prompt` are sampled `batch_size` at a time
    (`hf_stable.evaluation.map_eval.sample_completions`, batch i under seed `seed + i`), mapped to answers by
    `extract` (default: the stripped text) and fed one at a time; draws left in the last batch are discarded.

    `temperature` must be > 0 (a certificate needs independent draws); the rest as in `sample_completions`.
    """
    from .map_eval import sample_completions

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"`temperature` must be > 0 (independent sampled answers), got {temperature!r}.")
    alpha, max_samples = check_alpha(alpha), _check_budget(max_samples)
    extract = extract or (lambda text: text.strip())

    def answers():
        for i in range((max_samples + batch_size - 1) // batch_size):
            (group,) = sample_completions(
                model, tokenizer, [prompt], num_samples=batch_size, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, seed=seed + i, batch_size=1,
            )
            yield from (extract(text) for text in group)

    return certify_stream(answers(), alpha, max_samples)


def min_samples_to_certify(alpha: float) -> int:
    """The fewest draws after which any certificate is possible (all answers equal): the least n with
    w(1) M(n − 1, 0) ≥ 1/α, i.e. (2^n − 1) / (2n) ≥ 1/α."""
    alpha = check_alpha(alpha)
    n = 1
    while math.log(first_seen_weight(1)) + _log_mixture(n - 1, 0) < -math.log(alpha):
        n += 1
    return n


__all__: Sequence[str] = (
    "MMC_PAPER",
    "Certificate",
    "MMCState",
    "certify_majority",
    "certify_model_answer",
    "certify_stream",
    "first_seen_weight",
    "log_pair_evalue",
    "log_pair_evalues",
    "min_samples_to_certify",
    "mmc_log_evalues",
)

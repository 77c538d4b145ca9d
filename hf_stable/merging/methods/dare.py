"""Random sparsification of task vectors: DARE (keep each entry with probability `density`) and DELLA (keep
probability by magnitude rank within the row), then the generalised task-arithmetic combine of `ties.py`.

Semantics follow mergekit 0.1.5 `sparsify.py` (`bernoulli`, `della_magprune`, `rescaled_masked_tensor`) and its
registry entries (read, not copied):

* `dare_linear` / `dare_ties`: no consensus / sign consensus; `normalize: false`, `rescale: true` by default;
* `della` / `della_linear`: sign consensus with `normalize: true` / none with `normalize: false`; `rescale: true`;
* `rescale: true` scales the kept entries of each task vector to its L1 norm over the whole tensor,
  `‖τ_i‖₁ / ‖kept τ_i‖₁` (mergekit 0.1.5). The DARE paper's rescale, `kept / density`, is
  `rescale_norm: inverse_density` (also PEFT `utils/merge_utils.py::random_pruning`).

Masks are not drawn with `torch.bernoulli` (whose stream depends on every earlier draw): they come from
`hf_stable.merging.rng`, keyed on (seed, model index, tensor name, flat element index), so every chunking of a
tensor gets the same mask and a merge is reproducible from its seed. mergekit's masks therefore differ from ours
draw by draw; the kept fraction and the rescale rule are what agree (tests/merging/test_mergekit_parity.py).

DELLA's keep probability of an entry is `(density − ε) + 2ε · (r − 1)/(n − 1)`, `r` its ascending |τ| rank among
the `n` entries of its row (dim 1 of a matrix; a vector is one row), ties broken by position.

Papers: DARE — Yu et al. 2023, arXiv 2311.03099; DELLA — Deep et al. 2024, arXiv 2406.11617.
"""

from __future__ import annotations

import math

import torch

from hf_stable._validation import choice, number
from hf_stable.merging import rng
from hf_stable.papers import PAPERS
from hf_stable.registry import Field

from .base import _per_model, merge_method
from .ties import GeneralizedTaskArithmetic


_SORT_KEY = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def della_thresholds(magnitude: torch.Tensor, row_len: int, density: float, epsilon: float) -> torch.Tensor:
    """`(n,)` int64 keep thresholds of DELLA's magnitude-ranked sampling: an entry is kept when its 32 random bits
    (`rng.random_bits`) are below its threshold, i.e. when the uniform `bits · 2^-32` is below its keep probability
    `p = (density − ε) + r · (2ε / (n − 1))` (`r` its 0-based ascending rank in its row, ties broken by position):
    `u < p ⟺ bits < ⌈p · 2^32⌉`, so the mask is the float64 comparison's, bit for bit.

    Why integers: the ranks come from one stable sort of the magnitudes' bit patterns (non-negative floats order as
    their integer bit patterns do, and integer sorts are about a third faster), and a per-rank threshold table
    scattered to the entries replaces an `(n,)` float64 probability and uniform per model: DELLA was the one random
    method near mergekit's speed.

    Args:
        magnitude: `(n,)` |τ| of whole rows (`n` a multiple of `row_len`; float64, float32 or a 16-bit float).
        row_len: entries per row.
        density, epsilon: mean keep probability and its spread (`density ± epsilon` in (0, 1)).
    """
    rows = magnitude.reshape(-1, row_len)
    order = torch.sort(rows.view(_SORT_KEY[rows.element_size()]), dim=1, stable=True).indices
    scale = 1.0 / (row_len - 1) if row_len > 1 else 0.0
    ranks = torch.arange(row_len, dtype=torch.float64)
    table = torch.ceil(((density - epsilon) + ranks * scale * 2 * epsilon) * 2.0**32).to(torch.int64)
    thresholds = torch.empty_like(order)
    thresholds.scatter_(1, order, table.expand_as(order))
    return thresholds.reshape(-1)


MASK_CACHE_BYTES = 64 << 20  # per tensor: the keep masks (one byte per entry and model) kept between the passes


class _Sums(list):
    """Per model `[‖τ_i‖₁, ‖kept τ_i‖₁]` of one tensor (`l1_factors`), and the keep masks its L1 pass drew, for the
    combine of the same pieces: the masks are drawn once, not twice (DELLA's per-row sort is most of its time). They
    are held in one `(N, numel)` bool buffer (one allocation: many piece-sized ones fragmented the heap), when that
    fits in `MASK_CACHE_BYTES`; otherwise they are drawn again, with the same bits."""

    def __init__(self, n_models: int):
        super().__init__([0.0, 0.0] for _ in range(n_models))
        self.masks: torch.Tensor | None = None
        self.stored: set[tuple[int, int, int]] = set()


class _RandomMethod(GeneralizedTaskArithmetic):
    default_normalize = False
    default_rescale = True

    def densities(self, params, n_models):
        return None  # random, not magnitude, trimming: no thresholds needed

    def _dens(self, p, n_models):
        return _per_model(p["density"], n_models, "density", self.name)

    def new_sums(self, n_models):
        return _Sums(n_models)

    def accumulate(self, sums, v, weights, params, **kw):
        super().accumulate(sums, v, weights, params, masks=(sums, True), **kw)

    def combine(self, v, weights, params, *, sums=None, **kw):
        return super().combine(v, weights, params, sums=sums, masks=(sums, False), **kw)

    @staticmethod
    def keep(i, offset, n, draw, *, masks=None, n_models=1, shape=None, **kw):
        """Model i's `(n,)` bool keep mask of the piece at `offset`: `draw()`, or the one the L1 pass drew (`masks`:
        `(sums, store)` — the L1 pass stores, the combine takes)."""
        sums, store = masks if masks is not None else (None, False)
        if not isinstance(sums, _Sums):
            return draw()
        key = (i, offset, n)
        if not store:
            if key in sums.stored:
                sums.stored.discard(key)
                return sums.masks[i, offset : offset + n]
            return draw()
        mask = draw()
        numel = math.prod(shape) if shape is not None else offset + n
        if sums.masks is None and n_models * numel <= MASK_CACHE_BYTES:
            sums.masks = torch.empty(n_models, numel, dtype=torch.bool)
        if sums.masks is not None and offset + n <= sums.masks.shape[1]:
            sums.masks[i, offset : offset + n] = mask
            sums.stored.add(key)
        return mask


class _DareMethod(_RandomMethod):
    params = (
        *GeneralizedTaskArithmetic.params,
        Field(
            "rescale_norm",
            "l1",
            "What `rescale` preserves: `l1` (the L1 norm, mergekit 0.1.5) or `inverse_density` (kept / density, the "
            "DARE paper).",
            choice("l1", "inverse_density"),
        ),
    )

    def _validate(self, params, n_models, has_base):
        if params["rescale_norm"] != "l1" and not params["rescale"]:
            raise ValueError(
                f"{self.where}: `rescale_norm`={params['rescale_norm']!r} has no effect with `rescale`: false; set "
                "rescale: true or drop rescale_norm."
            )

    def sparsify(self, v, params, *, tensor_name, offset, seed, **kw):
        n = v.shape[-1]
        out = []
        for i, d in enumerate(self._dens(params, v.shape[0])):
            if d >= 1.0:
                out.append(None)
                continue
            draw = lambda i=i, d=d: rng.keep_mask(seed, i, tensor_name, offset, n, d)  # noqa: E731
            out.append(v[i] * self.keep(i, offset, n, draw, n_models=v.shape[0], **kw))
        return out


@merge_method("dare_linear", PAPERS["dare"])
class DareLinearMethod(_DareMethod):
    """Random drop (keep p = density) and rescale, then weighted sum of task vectors.

    DARE + task arithmetic (Yu et al. 2023, arXiv 2311.03099).

    Params: `weight` and `density` (keep probability; one per model), `lambda`, `normalize` (false), `rescale`
    (true), `rescale_norm` (`l1` | `inverse_density`), `int8_mask`.
    """

    consensus = False


@merge_method("dare_ties", PAPERS["dare"])
class DareTiesMethod(_DareMethod):
    """Random drop and rescale, then TIES sign election and disjoint merge of task vectors.

    DARE + TIES sign consensus (Yu et al. 2023, arXiv 2311.03099; Yadav et al. 2023, arXiv 2306.01708).

    Params as `dare_linear`; `normalize: true` divides by the weight sum of the agreeing models (PEFT behaviour).
    """

    consensus = True


class _DellaMethod(_RandomMethod):
    row_local = True
    params = (
        *GeneralizedTaskArithmetic.params,
        Field(
            "epsilon", 0.15, "Spread of the keep probability around density.", number(low=0, high=1), per_model=True
        ),
    )

    def _validate(self, params, n_models, has_base):
        dens = self._dens(params, n_models)
        eps = _per_model(params["epsilon"], n_models, "epsilon", self.name)
        for d, e in zip(dens, eps, strict=True):
            if d < 1 and (d + e >= 1 or d - e <= 0):
                raise ValueError(
                    f"{self.where}: `epsilon`={e} with `density`={d}: density ± epsilon must lie in (0, 1)."
                )

    def sparsify(self, v, params, *, tensor_name, offset, seed, row_len=None, **kw):
        n_models, n = v.shape
        dens = self._dens(params, n_models)
        eps = _per_model(params["epsilon"], n_models, "epsilon", self.name)
        out = []
        for i in range(n_models):
            if dens[i] >= 1:
                out.append(None)
                continue

            def draw(i=i):
                threshold = della_thresholds(v[i].abs(), row_len or n, dens[i], eps[i])
                return rng.random_bits(seed, i, tensor_name, offset, n) < threshold

            out.append(v[i] * self.keep(i, offset, n, draw, n_models=n_models, **kw))
        return out


@merge_method("della", PAPERS["della"])
class DellaMethod(_DellaMethod):
    """Magnitude-ranked random drop within rows (MagPrune), L1 rescale, TIES sign consensus.

    DELLA-Merging (Deep et al. 2024, arXiv 2406.11617) with TIES sign election.

    Params: `weight`, `density`, `epsilon` (0.15; one per model), `lambda`, `normalize` (true), `rescale` (true).
    """

    consensus = True
    default_normalize = True


@merge_method("della_linear", PAPERS["della"])
class DellaLinearMethod(_DellaMethod):
    """Magnitude-ranked random drop within rows (MagPrune), L1 rescale, weighted sum.

    DELLA-Merging (Deep et al. 2024, arXiv 2406.11617) without sign consensus.
    """

    consensus = False

"""DARE (drop and rescale): random Bernoulli(density) keep mask per task-vector entry, kept entries / density.

Semantics follow mergekit `sparsify.py::bernoulli` + `merge_methods/generalized_task_arithmetic.py` (registry
entries `dare_linear`: no consensus; `dare_ties`: "sum" sign consensus; both `normalize=false`, `rescale=true` by
default) and PEFT `utils/merge_utils.py::random_pruning` (`tensor * mask / density`) (read, not copied).
The mask is not drawn with `torch.bernoulli`: it comes from `hf_stable.merging.rng.keep_mask`, keyed on
(seed, model index, tensor name, flat element index), so every tiling of a tensor gets the same mask.

Note: PEFT's `dare_ties` always divides by the count of agreeing models; mergekit (and this) only when
`normalize: true`.
Paper: Yu et al. 2023, "Language models are Super Mario: absorbing abilities from homologous models as a free
lunch", arXiv 2311.03099.
"""

from __future__ import annotations

from hf_stable.merging import rng
from hf_stable.merging.methods.base import MERGE_METHODS, _per_model
from hf_stable.merging.methods.ties import GeneralizedTaskArithmetic, gta_combine


def dare_keep(n_models: int, densities, tensor_name: str, offset: int, n: int, seed: int):
    """Per-model `(n,)` bool keep masks for elements `offset … offset+n−1` (None where density ≥ 1)."""
    return [None if d >= 1.0 else rng.keep_mask(seed, i, tensor_name, offset, n, d) for i, d in enumerate(densities)]


class _DareMethod(GeneralizedTaskArithmetic):
    param_defaults = {"density": 1.0, "lambda": 1.0, "normalize": False, "rescale": True}

    def density(self, params):
        return None  # random, not magnitude, trimming: no thresholds needed

    def combine(self, v, weights, params, *, thresholds, tensor_name, offset, seed):
        p = self.resolve(params)
        n_models, n = v.shape[0], v.shape[-1]
        dens = _per_model(p["density"], n_models, "density", self.name)
        return gta_combine(
            v,
            weights,
            keep=dare_keep(n_models, dens, tensor_name, offset, n, seed),
            rescale=list(dens) if p["rescale"] else None,
            consensus=self.consensus,
            normalize=bool(p["normalize"]),
            lam=float(p["lambda"]),
        )


@MERGE_METHODS.register(
    "dare_linear",
    paper="Yu et al. 2023, DARE (arXiv 2311.03099)",
    url="https://arxiv.org/abs/2311.03099",
    description="Random drop (keep p = density) and rescale 1/density, then weighted sum of task vectors.",
)
class DareLinearMethod(_DareMethod):
    """DARE + task arithmetic (Yu et al. 2023, arXiv 2311.03099).

    Params: `density` (keep probability, 1.0; scalar or per model), `lambda` (1.0), `normalize` (false),
    `rescale` (true: kept entries divided by density).
    """

    default_name = "dare_linear"
    consensus = False


@MERGE_METHODS.register(
    "dare_ties",
    paper="Yu et al. 2023, DARE (arXiv 2311.03099) + TIES sign consensus (arXiv 2306.01708)",
    url="https://arxiv.org/abs/2311.03099",
    description="Random drop and rescale, then TIES sign election and disjoint merge of task vectors.",
)
class DareTiesMethod(_DareMethod):
    """DARE + TIES sign consensus (Yu et al. 2023, arXiv 2311.03099; Yadav et al. 2023, arXiv 2306.01708).

    Params as `dare_linear`; `normalize: true` divides by the weight sum of the agreeing models (PEFT behaviour).
    """

    default_name = "dare_ties"
    consensus = True

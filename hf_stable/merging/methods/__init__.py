"""Merge methods, registered by name in `MERGE_METHODS` (importing this package registers all of them).

`MERGE_METHODS.get(name).fn` is a zero-argument factory returning a `MergeMethod`; use `get_merge_method(name)`.

| name | kind | space | paper |
|---|---|---|---|
| `linear` | gram (no Gram needed) | weights | Wortsman et al. 2022 (model soups) |
| `task_arithmetic` | gram (no Gram needed) | task_vector | Ilharco et al. 2022 |
| `ties` | elementwise (magnitude thresholds) | task_vector | Yadav et al. 2023 |
| `dare_linear`, `dare_ties` | elementwise (counter-based RNG) | task_vector | Yu et al. 2023 |
| `slerp` | gram | weights (or task_vector) | Shoemake 1985 |
| `fisher_rao` (alias `karcher`), `nre`, `nre_unit` | gram | weights or task_vector | Wang, Ye, Yin 2026 |
| `wsm` | gram (no Gram needed) | weights (ordered checkpoints) | WSM, arXiv 2507.17634 |
"""

from hf_stable.merging.methods import dare as _dare  # noqa: F401
from hf_stable.merging.methods import fisher_rao as _fisher_rao  # noqa: F401

# Importing the method modules registers them (order = listing order).
from hf_stable.merging.methods import linear as _linear  # noqa: F401
from hf_stable.merging.methods import slerp as _slerp  # noqa: F401
from hf_stable.merging.methods import task_arithmetic as _task_arithmetic  # noqa: F401
from hf_stable.merging.methods import ties as _ties  # noqa: F401
from hf_stable.merging.methods import wsm as _wsm  # noqa: F401
from hf_stable.merging.methods.base import (
    MERGE_METHODS,
    PASSTHROUGH_PARAMS,
    SPACES,
    ElementwiseMethod,
    GramMethod,
    MergeMethod,
    apply_coefficients,
    gather_params,
    get_merge_method,
    keep_count,
    per_model,
)


__all__ = [
    "MERGE_METHODS",
    "PASSTHROUGH_PARAMS",
    "SPACES",
    "ElementwiseMethod",
    "GramMethod",
    "MergeMethod",
    "apply_coefficients",
    "gather_params",
    "get_merge_method",
    "keep_count",
    "per_model",
]

"""Merge methods, registered by name in `MERGE_METHODS` (importing this package registers all of them).

`MERGE_METHODS.get(name).fn` is a zero-argument factory returning a `MergeMethod`; use `get_merge_method(name)`.
Each module registers its methods when imported (`@merge_method(name, paper)` on the class); the registry lists them
in import order, which is the alphabetical order of the modules below (not an order of preference).
`docs/merging.md` has the table of methods, their parameters and papers.
"""

from hf_stable.merging.methods import arcee_fusion as _arcee_fusion  # noqa: F401
from hf_stable.merging.methods import dare as _dare  # noqa: F401  (dare_linear, dare_ties, della, della_linear)
from hf_stable.merging.methods import fisher_rao as _fisher_rao  # noqa: F401  (multislerp, fisher_rao, karcher, ...)
from hf_stable.merging.methods import fw_merging as _fw_merging  # noqa: F401
from hf_stable.merging.methods import linear as _linear  # noqa: F401  (linear, passthrough)
from hf_stable.merging.methods import model_stock as _model_stock  # noqa: F401
from hf_stable.merging.methods import nearswap as _nearswap  # noqa: F401
from hf_stable.merging.methods import ram as _ram  # noqa: F401  (ram, ramplus_tl)
from hf_stable.merging.methods import sce as _sce  # noqa: F401
from hf_stable.merging.methods import slerp as _slerp  # noqa: F401  (slerp, nuslerp)
from hf_stable.merging.methods import task_arithmetic as _task_arithmetic  # noqa: F401
from hf_stable.merging.methods import ties as _ties  # noqa: F401  (ties, breadcrumbs, breadcrumbs_ties)
from hf_stable.merging.methods import wsm as _wsm  # noqa: F401
from hf_stable.merging.methods.base import (
    MERGE_METHODS,
    SPACES,
    ElementwiseMethod,
    GramMethod,
    MergeMethod,
    Param,
    apply_coefficients,
    gather_params,
    get_merge_method,
    keep_count,
    merge_method,
    per_model,
)


__all__ = [
    "MERGE_METHODS",
    "SPACES",
    "ElementwiseMethod",
    "GramMethod",
    "MergeMethod",
    "Param",
    "apply_coefficients",
    "gather_params",
    "get_merge_method",
    "keep_count",
    "merge_method",
    "per_model",
]

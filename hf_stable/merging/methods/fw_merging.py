"""FW-Merging's registration: a data-driven method, run by `hf_stable.merging.fw.fw_merge_from_config` with its own
recipe schema (`pool`, `objective`), not by the streaming engine.

Paper: Chen et al. 2025, "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization", arXiv 2503.12649.
"""

from __future__ import annotations

from hf_stable.papers import PAPERS

from .base import MergeMethod, merge_method


@merge_method("fw_merging", PAPERS["fw_merging"])
class FWMergingMethod(MergeMethod):
    """Frank–Wolfe over the layer-wise convex hull of a pool of checkpoints, guided by a data objective.

    Data-driven merge (its parameters are validated by `hf_stable.merging.fw`).
    """

    kind = "data"
    base = "task_vector"
    data_driven = True

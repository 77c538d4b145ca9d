"""The paper index: every registered method's paper is in `docs/paper_index.md`, and `hf-stable list` shows the
stability monitors (innovation probe, representation drift) under their family with their papers."""

from __future__ import annotations

import io
from pathlib import Path

from hf_stable.papers import PAPERS
from hf_stable.registry import _FAMILIES, _load_all, get_registry, list_methods


DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_registered_paper_is_in_the_paper_index():
    _load_all()
    index = (DOCS / "paper_index.md").read_text()
    missing = [
        f"{family}:{method.name} ({method.paper.arxiv})"
        for family, registry in _FAMILIES.items()
        for method in registry
        if getattr(method.paper, "arxiv", None) and f"arxiv.org/abs/{method.paper.arxiv}" not in index
    ]
    assert not missing, f"papers registered but absent from docs/paper_index.md: {missing}"


def test_stability_monitors_are_listed_with_their_papers():
    from hf_stable.callbacks import RepresentationDriftCallback, StabilityGuardCallback

    registry = get_registry("stability_monitor")
    probe, drift = registry.get("innovation_probe"), registry.get("representation_drift")
    assert probe.fn is StabilityGuardCallback and probe.paper is PAPERS["innovation_probe"]
    assert drift.fn is RepresentationDriftCallback and drift.paper is PAPERS["geometric_canary"]
    out = io.StringIO()
    listing = list_methods("stability_monitor", file=out)
    assert listing == {"stability_monitor": ["innovation_probe", "representation_drift"]}
    text = out.getvalue()
    assert "innovation_probe" in text and "https://arxiv.org/abs/2601.17483" in text
    assert "representation_drift" in text and "https://arxiv.org/abs/2604.17698" in text

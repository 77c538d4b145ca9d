"""The unlearning methods: which forget loss, which retain term and which optimisation scheme each one uses.

Light on purpose (no torch): `UnlearningConfig.__post_init__` validates names against this registry, and
`hf-stable list` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..papers import PAPERS
from ..registry import Registry


UNLEARNING_METHODS = Registry("unlearning_method", "unlearning methods (forget loss + retain term + scheme)")


@dataclass(frozen=True)
class MethodSpec:
    forget_loss: str | None  # a FORGET_LOSSES name; None: chosen by a config field (PDU, StableUN)
    retain_loss: str  # default retain_loss_type
    forget_weight: float = 1.0
    scheme: str = "joint"  # "joint" (one loss), "dual" (primal-dual), "multipoint" (StableUN), "sga"


def _spec(name, paper, **kwargs):
    spec = MethodSpec(**kwargs)
    UNLEARNING_METHODS.register(name, paper=PAPERS[paper].short, url=PAPERS[paper].url)(lambda spec=spec: spec)


_spec("ga", "ga_unlearning", forget_loss="ga", retain_loss="none")
_spec("graddiff", "ga_unlearning", forget_loss="ga", retain_loss="nll")
_spec("npo", "npo", forget_loss="npo", retain_loss="nll")
_spec("simnpo", "simnpo", forget_loss="simnpo", retain_loss="nll", forget_weight=0.1375)
_spec("sga", "sga", forget_loss="sga", retain_loss="none", scheme="sga")
_spec("pdu", "pdu", forget_loss=None, retain_loss="nll", scheme="dual")
_spec("stableun", "stableun", forget_loss=None, retain_loss="nll", scheme="multipoint")
_spec("dmm", "dmm", forget_loss="dmm", retain_loss="none")


def method_spec(name: str) -> MethodSpec:
    return UNLEARNING_METHODS.get(name).fn()

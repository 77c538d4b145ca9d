"""Former location of `UnlearningConfig`, now `hf_stable.trainers.unlearning.config`; kept for existing imports."""

from .unlearning.config import UnlearningConfig


__all__ = ["UnlearningConfig"]

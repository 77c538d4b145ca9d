"""`StableLoraConfig`: PEFT's `LoraConfig` with hf_stable's variants as `is_lora_variant` fields."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from peft import LoraConfig


@dataclass
class StableLoraConfig(LoraConfig):
    """[`peft.LoraConfig`] plus MAP and bounded sine adapters. Pass it as `peft_config` to any TRL or hf_stable
    trainer, or to `peft.get_peft_model`; with neither variant switched on it is a plain `LoraConfig`.

    Args:
        use_map (`bool`, defaults to `False`):
            MAP / LoMAP (arXiv 2505.23094): `W' = (1 + a) W0 + ‖W0‖_F b · BA/‖BA‖_F` with trainable scalars a, b per
            layer. `lora_alpha` and `use_rslora` have no effect under MAP (the scale cancels).
        map_init_b_std (`float`, defaults to `1e-3`):
            Standard deviation of B's initialisation under MAP (B must not start at zero).
        map_scalar_lr (`float`, *optional*):
            Learning rate of the MAP scalars (their own optimiser group, no weight decay); default: the trainer's.
        use_sine (`bool`, defaults to `False`):
            Bounded sine adapter: `ΔW = s · sin(ω BA)/g`, every entry within `s/g` (for stable unlearning).
        sine_freq (`float`, defaults to `100.0`):
            ω.
        sine_g (`str` or `float`, defaults to `"sqrt_in"`):
            g: `"sqrt_in"` (√in_features, the reference) or a number.
    """

    use_map: bool = field(default=False, metadata={"help": "MAP / LoMAP adapter.", "is_lora_variant": True})
    map_init_b_std: float = field(default=1e-3, metadata={"help": "Std of B's init under MAP (B must not be 0)."})
    map_scalar_lr: float | None = field(default=None, metadata={"help": "Learning rate of the MAP scalars."})
    use_sine: bool = field(default=False, metadata={"help": "Bounded sine adapter.", "is_lora_variant": True})
    sine_freq: float = field(default=100.0, metadata={"help": "Sine frequency ω."})
    sine_g: str | float = field(default="sqrt_in", metadata={"help": "Sine gain g: 'sqrt_in' or a number."})
    hf_stable_version: str | None = field(default=None, metadata={"help": "Set on save; marks hf_stable adapters."})

    def __post_init__(self):
        super().__post_init__()
        if self.use_map and self.use_sine:
            raise ValueError("`use_map` and `use_sine` cannot be combined; choose one variant.")
        if (self.use_map or self.use_sine) and self.use_dora:
            raise ValueError(
                f"`use_dora` cannot be combined with `use_{'map' if self.use_map else 'sine'}`: both re-parameterise "
                "the same update. Choose one."
            )
        if (self.use_map or self.use_sine) and self.lora_bias:
            raise ValueError("`lora_bias=True` is not supported with `use_map`/`use_sine`.")
        if self.map_init_b_std <= 0:
            raise ValueError(f"`map_init_b_std` must be > 0 (B = 0 deadlocks MAP), got {self.map_init_b_std}.")
        if self.map_scalar_lr is not None and self.map_scalar_lr <= 0:
            raise ValueError(f"`map_scalar_lr` must be > 0, got {self.map_scalar_lr}.")
        if self.sine_freq <= 0 or (not isinstance(self.sine_g, str) and float(self.sine_g) <= 0):
            raise ValueError(f"`sine_freq` and a numeric `sine_g` must be > 0, got {self.sine_freq}, {self.sine_g}.")
        if isinstance(self.sine_g, str) and self.sine_g != "sqrt_in":
            try:
                self.sine_g = float(self.sine_g)
            except ValueError:
                raise ValueError(f"`sine_g` must be 'sqrt_in' or a number, got {self.sine_g!r}.") from None
        if self.use_map and (self.use_rslora or self.lora_alpha != 8):
            warnings.warn(
                "`lora_alpha`/`use_rslora` have no effect under MAP: the LoRA scale cancels in BA/‖BA‖.", stacklevel=2
            )
        if self.use_map or self.use_sine:
            from .layers import custom_modules

            self._register_custom_module(custom_modules())
            from .. import __version__

            self.hf_stable_version = __version__

    @classmethod
    def from_saved_dict(cls, values: dict) -> StableLoraConfig:
        """Build from a saved `adapter_config.json` dictionary (unknown keys of newer PEFT versions are dropped)."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in values.items() if k in known})

    @property
    def hf_stable_variant(self) -> str | None:
        return "map" if self.use_map else "sine" if self.use_sine else None

"""`StableLoraConfig`: PEFT's `LoraConfig` with hf_stable's variants as `is_lora_variant` fields."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from peft import LoraConfig

from .._adapter_variants import ADAPTER_VARIANTS, PEFT_TYPE, SAVED_PEFT_TYPE, VARIANT_KEYS
from .._version import __version__
from .svd import SVD_TRAINABLE


MAP_SCALE_WARNING = "have no effect under MAP"
SVD_SCALE_WARNING = "have no effect under SVD"
# `init_lora_weights` values MAP and sine accept: they leave the base weight alone and give the base model at step 0
BASE_PRESERVING_INITS = (True, False, "gaussian", "orthogonal")
# why the others are refused, by the value (or prefix) PEFT dispatches on (`peft/tuners/lora/layer.py: update_layer`)
_STEP0 = "so the model at step 0 would not be the base model"
REFUSED_INITS = {
    "pissa": f"PiSSA subtracts its initial update from the base weight (W0 - BA), {_STEP0}",
    "olora": f"OLoRA subtracts its initial update from the base weight (W0 - BA), {_STEP0}",
    "corda": f"CorDA subtracts its initial update from the base weight (W0 - BA), {_STEP0}",
    "lora_ga": f"LoRA-GA subtracts its initial update from the base weight (W0 - BA), {_STEP0}",
    "loftq": f"LoftQ replaces the base weight by a quantised residual, {_STEP0}",
    "eva": "EVA sets A from activations after construction and redistributes ranks, which the variant's layer state "
    "does not follow",
    "mica": "MiCA is a PEFT variant of its own (B frozen)",
}


@dataclass
class StableLoraConfig(LoraConfig):
    """[`peft.LoraConfig`] plus MAP, bounded sine and singular-value (SVD) adapters. Pass it as `peft_config` to any
    TRL or hf_stable trainer, or to `peft.get_peft_model`; with no variant switched on it is a plain `LoraConfig`.

    Args:
        use_map (`bool`, defaults to `False`):
            MAP / LoMAP (Si et al., arXiv 2505.23094): `W' = (1 + a) W0 + ‖W0‖_F b · BA/‖BA‖_F` with trainable scalars
            a, b per layer. `lora_alpha` and `use_rslora` have no effect under MAP (the scale cancels). Cannot be
            merged into a 4-bit base in place; export with `hf_stable.adapters.merge_and_export`.
        map_init_b_std (`float`, defaults to `1e-3`):
            Standard deviation of B's initialisation under MAP (B must not start at zero).
        map_scalar_lr (`float`, *optional*):
            Learning rate of the MAP scalars (their own optimiser group, no weight decay); default: the trainer's.
        use_sine (`bool`, defaults to `False`):
            Bounded sine adapter (Ji et al., ICLR 2025 Sine-LoRA; used for stable unlearning in arXiv 2509.24166):
            `ΔW = s · sin(ω BA)/g`, every entry within `s/g`. Full-precision bases only.
        sine_freq (`float`, defaults to `100.0`):
            ω.
        sine_g (`str` or `float`, defaults to `"sqrt_in"`):
            g: `"sqrt_in"` (√in_features, the reference) or a positive number.
        use_svd (`bool`, defaults to `False`):
            Singular-value fine-tuning (CLOVER, Meng et al., arXiv 2411.17426): `W0 = U S Vᵀ` once in fp32, U and V
            frozen, `W' = W0 + U diag(δ) Vᵀ` with δ trained (0 at init). `r` is how many leading singular directions
            each layer keeps (`r >= min(out, in)`: all of them, a full-rank update). `lora_alpha`/`use_rslora` have no
            effect; `init_lora_weights` is overwritten by the bases. Full-precision `nn.Linear`/`Conv1D` only.
        svd_trainable (`str`, defaults to `"diagonal"`):
            `"diagonal"`: train δ ∈ ℝʳ (the singular values); `"matrix"`: train `M ∈ ℝʳˣʳ`, `W' = W0 + U M Vᵀ`
            (the paper's code: linear combinations of the frozen singular vectors).
    """

    use_map: bool = field(default=False, metadata={"help": "MAP / LoMAP adapter.", "is_lora_variant": True})
    map_init_b_std: float = field(default=1e-3, metadata={"help": "Std of B's init under MAP (B must not be 0)."})
    map_scalar_lr: float | None = field(default=None, metadata={"help": "Learning rate of the MAP scalars."})
    use_sine: bool = field(default=False, metadata={"help": "Bounded sine adapter.", "is_lora_variant": True})
    sine_freq: float = field(default=100.0, metadata={"help": "Sine frequency ω."})
    sine_g: str | float = field(default="sqrt_in", metadata={"help": "Sine gain g: 'sqrt_in' or a number."})
    use_svd: bool = field(
        default=False, metadata={"help": "Singular-value fine-tuning (frozen U, V).", "is_lora_variant": True}
    )
    svd_trainable: str = field(default="diagonal", metadata={"help": "SVD adapter: 'diagonal' or 'matrix'."})
    hf_stable_version: str | None = field(default=None, metadata={"help": "Set on save; marks hf_stable adapters."})

    def __post_init__(self):
        self._check_init()  # before PEFT's own checks, so that e.g. LoftQ is refused for what it does to the base
        super().__post_init__()
        self._validate_values()
        self._refuse_inert_settings()
        variant = self.hf_stable_variant
        switched = [key for key in VARIANT_KEYS if getattr(self, key)]
        if len(switched) > 1:
            raise ValueError(f"{' and '.join(f'`{key}`' for key in switched)} cannot be combined; choose one variant.")
        if variant and self.use_dora:
            raise ValueError(
                f"`use_dora` cannot be combined with `use_{variant}`: both reparameterise the same update; choose one."
            )
        if variant and self.lora_bias:
            raise ValueError(f"`lora_bias=True` is not supported with `use_{variant}`.")
        others = [name for name in _requested_peft_variants(self) if name not in ("use_dora", *VARIANT_KEYS)]
        if variant and others:
            raise ValueError(f"`use_{variant}` cannot be combined with the PEFT variant(s) {others}.")
        if self.use_map and (self.use_rslora or self.lora_alpha != 8 or self.alpha_pattern):
            warnings.warn(
                f"`lora_alpha`/`alpha_pattern`/`use_rslora` {MAP_SCALE_WARNING}: the LoRA scale cancels in BA/‖BA‖.",
                stacklevel=3,
            )
        if self.use_svd and (self.use_rslora or self.lora_alpha != 8 or self.alpha_pattern):
            warnings.warn(
                f"`lora_alpha`/`alpha_pattern`/`use_rslora` {SVD_SCALE_WARNING}: δ is in singular-value units.",
                stacklevel=3,
            )
        if variant:
            from .layers import custom_modules

            self._register_custom_module(custom_modules())

    def _check_init(self) -> None:
        """MAP keeps W0 and reads ‖W0‖ from it, and sine adds a bounded term to it: an init that rewrites the base
        weight makes the step-0 model differ from the base (measured: 1e-2 logit error with PiSSA) and the saved
        adapter apply to a base nobody has."""
        variant, init = self.hf_stable_variant, self.init_lora_weights
        if variant is None or any(init is v or (isinstance(init, str) and init == v) for v in BASE_PRESERVING_INITS):
            return
        key = init.lower() if isinstance(init, str) else init
        reason = next(
            (why for name, why in REFUSED_INITS.items() if isinstance(key, str) and key.startswith(name)), None
        )
        allowed = ", ".join(repr(v) for v in BASE_PRESERVING_INITS)
        raise ValueError(
            f"`init_lora_weights`={init!r} cannot be used with `use_{variant}`"
            + (f": {reason}" if reason else "")
            + f". Allowed with `use_{variant}`: {allowed}."
        )

    def _refuse_inert_settings(self) -> None:
        """A variant's settings (the fields named `<variant>_...`) act only with that variant switched on."""
        for name, key in ADAPTER_VARIANTS.items():
            if getattr(self, key):
                continue
            for setting in variant_settings(name):
                value, default = getattr(self, setting.name), setting.default
                if value != default:
                    raise ValueError(
                        f"`{setting.name}`={value!r} only acts with `{key}=True`, which is off: set `{key}=True` "
                        f"or leave `{setting.name}` at its default {default!r}."
                    )

    def _validate_values(self) -> None:
        # `not x > 0` also catches NaN
        if not _finite(self.map_init_b_std) or not self.map_init_b_std > 0:
            raise ValueError(f"`map_init_b_std` must be > 0 (B = 0 deadlocks MAP), got {self.map_init_b_std!r}.")
        if self.map_scalar_lr is not None and (not _finite(self.map_scalar_lr) or not self.map_scalar_lr > 0):
            raise ValueError(f"`map_scalar_lr` must be > 0, got {self.map_scalar_lr!r}.")
        if not _finite(self.sine_freq) or not self.sine_freq > 0:
            raise ValueError(f"`sine_freq` must be a finite number > 0, got {self.sine_freq!r}.")
        if self.sine_g != "sqrt_in":
            try:
                gain = float(self.sine_g)
            except (TypeError, ValueError):
                raise ValueError(f"`sine_g` must be 'sqrt_in' or a number, got {self.sine_g!r}.") from None
            if not math.isfinite(gain) or not gain > 0:
                raise ValueError(f"`sine_g` must be 'sqrt_in' or a finite number > 0, got {self.sine_g!r}.")
            self.sine_g = gain
        if self.svd_trainable not in SVD_TRAINABLE:
            raise ValueError(
                f"`svd_trainable` must be one of {', '.join(map(repr, SVD_TRAINABLE))}, got {self.svd_trainable!r}."
            )

    def to_dict(self) -> dict:
        values = super().to_dict()
        if self.hf_stable_variant:  # stamped at save time: the version that wrote the file
            values["hf_stable_version"] = __version__
            # a `peft_type` stock PEFT does not know: without hf_stable the load fails loudly instead of silently
            # building plain LoRA (see `hf_stable._peft_hook`)
            values["peft_type"] = SAVED_PEFT_TYPE
        return values

    @classmethod
    def from_saved_dict(cls, values: dict) -> StableLoraConfig:
        """Build from a saved `adapter_config.json` dictionary. Keys this version does not know (a newer PEFT's) are
        dropped with a warning, as PEFT does; the MAP scale warning is not repeated for a saved adapter."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            warnings.warn(
                f"Ignoring adapter config keys unknown to this PEFT/hf_stable version: {unknown}.", stacklevel=2
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{MAP_SCALE_WARNING}")
            warnings.filterwarnings("ignore", message=f".*{SVD_SCALE_WARNING}")
            kwargs = {k: v for k, v in values.items() if k in known}
            if kwargs.get("peft_type") == SAVED_PEFT_TYPE:
                kwargs["peft_type"] = PEFT_TYPE
            return cls(**kwargs)

    @property
    def hf_stable_variant(self) -> str | None:
        return next((name for name, key in ADAPTER_VARIANTS.items() if getattr(self, key)), None)


def variant_settings(variant: str) -> list[dataclasses.Field]:
    """The `StableLoraConfig` fields of one variant (`"map"`, `"sine"`, `"svd"`): those named `<variant>_...`."""
    return [f for f in dataclasses.fields(StableLoraConfig) if f.name.startswith(f"{variant}_")]


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _requested_peft_variants(config) -> list[str]:
    """Variant switches that are on, as PEFT's resolver reads them (`LoraLayer.resolve_lora_variant`)."""
    names = []
    for f in dataclasses.fields(config):
        if f.name == "init_lora_weights":
            names += [name for name in f.metadata.get("lora_variants", ()) if config.init_lora_weights == name]
        elif f.metadata.get("is_lora_variant") and getattr(config, f.name):
            names.append(f.name)
    return names

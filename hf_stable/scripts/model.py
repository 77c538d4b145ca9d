"""`StableModelConfig`: TRL's `ModelConfig` plus the hf_stable LoRA variants, for the command-line scripts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import ModelConfig

from hf_stable._peft_hook import ADAPTER_VARIANTS


LORA_VARIANTS = tuple(ADAPTER_VARIANTS)


@dataclass
class StableModelConfig(ModelConfig):
    """[`trl.ModelConfig`] plus hf_stable's LoRA variants (`--use_peft --lora_variant map`).

    Parameters:
        lora_variant (`str`, *optional*):
            `"map"` (MAP / LoMAP) or `"sine"` (bounded sine adapter); see `hf_stable.adapters.StableLoraConfig`.
        map_scalar_lr (`float`, *optional*):
            Learning rate of the MAP scalars; default: the trainer's.
        map_init_b_std (`float`, *optional*, defaults to `1e-3`):
            Standard deviation of B's initialisation under MAP.
        sine_freq (`float`, *optional*, defaults to `100.0`):
            ω of the sine adapter.
        sine_g (`str`, *optional*, defaults to `"sqrt_in"`):
            g of the sine adapter: `"sqrt_in"` or a number.
    """

    lora_variant: str | None = field(default=None, metadata={"help": "hf_stable LoRA variant: 'map' or 'sine'."})
    map_scalar_lr: float | None = field(default=None, metadata={"help": "Learning rate of the MAP scalars."})
    map_init_b_std: float = field(default=1e-3, metadata={"help": "Std of B's initialisation under MAP."})
    sine_freq: float = field(default=100.0, metadata={"help": "Sine adapter frequency ω."})
    sine_g: str = field(default="sqrt_in", metadata={"help": "Sine adapter gain g: 'sqrt_in' or a number."})

    def __post_init__(self):
        super().__post_init__()
        if self.lora_variant is not None and self.lora_variant not in LORA_VARIANTS:
            raise ValueError(
                f"`lora_variant`={self.lora_variant!r} is not valid. Allowed values: {', '.join(LORA_VARIANTS)}."
            )
        if self.lora_variant is not None and not self.use_peft:
            raise ValueError(f"`lora_variant`={self.lora_variant!r} needs `use_peft=True`.")
        defaults = {f.name: f.default for f in dataclasses.fields(StableModelConfig)}
        for variant in LORA_VARIANTS:
            for name in _variant_settings(variant):
                if variant != self.lora_variant and getattr(self, name) != defaults[name]:
                    raise ValueError(
                        f"`{name}` only applies to lora_variant={variant!r}; got lora_variant={self.lora_variant!r}."
                    )


def get_stable_peft_config(model_args: ModelConfig):
    """TRL's `get_peft_config`, returning a `StableLoraConfig` with the requested variant (or TRL's `LoraConfig`
    unchanged when none is requested or `model_args` is a plain `ModelConfig`)."""
    from trl import get_peft_config

    config = get_peft_config(model_args)
    variant = getattr(model_args, "lora_variant", None)
    if config is None or variant is None:
        return config
    from hf_stable.adapters import StableLoraConfig

    fields = {f.name for f in dataclasses.fields(config) if f.init}
    values = {name: getattr(config, name) for name in fields}
    values[ADAPTER_VARIANTS[variant]] = True
    values.update({name: getattr(model_args, name) for name in _variant_settings(variant)})
    return StableLoraConfig(**values)


def _variant_settings(variant: str) -> list[str]:
    """The `StableModelConfig` fields of one variant: named `<variant>_...`, as on `StableLoraConfig`."""
    return [f.name for f in dataclasses.fields(StableModelConfig) if f.name.startswith(f"{variant}_")]

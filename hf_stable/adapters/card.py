"""What a model card says about the adapters a model carries (used by every trainer's `create_model_card`)."""

from __future__ import annotations

import enum

from ..papers import PAPERS


def adapter_card_info(model) -> tuple[list, list[str], dict, list[str]]:
    """`(papers, method lines, settings, tags)` for the PEFT adapters on ``model`` (all empty without adapters).

    MAP, sine and SVD adapters are flagged as needing hf_stable to load: stock PEFT refuses them (their saved
    `peft_type`).
    """
    papers, lines, settings, tags = [], [], {}, []
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        variant = getattr(config, "hf_stable_variant", None)
        kind = _peft_kind(config)
        if variant is None and kind != "lora":  # IA3, LoHa, prompt/prefix tuning, ...: no rank or alpha to report
            fields = {k: _plain(getattr(config, k)) for k in _SETTINGS if hasattr(config, k)}
            settings[name] = {"variant": kind, **fields}
            continue
        entry = {"variant": variant or "lora", "r": config.r, "target_modules": _plain(config.target_modules)}
        if variant == "map":
            papers.append(PAPERS["map"])
            lines.append(
                f"Adapter `{name}`: MAP (LoMAP), `W' = (1 + a)·W0 + ‖W0‖·b·BA/‖BA‖` with learned scalars per layer."
            )
            entry.update(map_scalar_lr=config.map_scalar_lr, map_init_b_std=config.map_init_b_std)
            tags.append("map")
        elif variant == "sine":
            papers += [PAPERS["sine_lora"], PAPERS["stable_forgetting"]]
            lines.append(f"Adapter `{name}`: bounded sine update `s·sin(ω·BA)/g`, every entry within `s/g`.")
            entry.update(sine_freq=config.sine_freq, sine_g=config.sine_g)
            tags.append("sine-lora")
        elif variant == "svd":
            papers.append(PAPERS["clover"])
            lines.append(
                f"Adapter `{name}`: singular-value fine-tuning, `W' = W0 + U·diag(δ)·Vᵀ` (`svd_trainable="
                f"{config.svd_trainable!r}`) with the base weight's singular vectors U, V frozen."
            )
            entry.update(svd_trainable=config.svd_trainable)
            tags.append("svd")
        else:
            entry.update(lora_alpha=config.lora_alpha, use_rslora=config.use_rslora, use_dora=config.use_dora)
        if getattr(config, "use_rslora", False) and variant is None:
            papers.append(PAPERS["rslora"])
        if variant is not None:
            lines.append(
                "Loading it needs hf_stable (`pip install hf-stable`, then `import hf_stable` before "
                "`PeftModel.from_pretrained`, or `hf_stable.adapters.load_adapter`): stock PEFT refuses it (its "
                "`peft_type` names hf_stable). `hf_stable.adapters.merge_and_export` writes a merged model that needs "
                "nothing extra."
            )
        settings[name] = entry
    return list(dict.fromkeys(papers)), lines, ({"adapters": settings} if settings else {}), tags


# the fields a card reports for a non-LoRA PEFT method, when its config has them (PEFT's own names)
_SETTINGS = (
    "r", "alpha", "target_modules", "feedforward_modules", "num_virtual_tokens", "prompt_tuning_init",
    "encoder_hidden_size", "encoder_reparameterization_type", "prefix_projection",
)  # fmt: skip


def _peft_kind(config) -> str:
    """PEFT's method name in lower case (`lora`, `ia3`, `loha`, `prompt_tuning`, `p_tuning`, ...)."""
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind) or "unknown").lower()


def _plain(value):
    if isinstance(value, enum.Enum):  # PEFT's `PromptTuningInit`, `PromptEncoderReparameterizationType`: YAML-safe
        return value.value
    return sorted(value) if isinstance(value, (set, frozenset)) else value

"""Adapter configurations exercised under both trainers, shared by the in-process tests and the DDP script."""

from hf_stable.adapters import StableLoraConfig


MLP = ["gate_proj", "up_proj", "down_proj"]


def adapter_config(kind: str) -> StableLoraConfig:
    if kind == "map":
        return StableLoraConfig(r=4, target_modules="all-linear", use_map=True, lora_dropout=0.0)
    if kind == "sine":
        # ω = 10 keeps the tiny model's sine in its near-linear range; the bound is tested with the default ω.
        return StableLoraConfig(
            r=4, target_modules=MLP, use_sine=True, sine_freq=10.0, lora_dropout=0.0, init_lora_weights="gaussian"
        )
    if kind == "svd":
        # r = 64 = min(out, in) of every tiny-model layer: all singular values train (the paper's full-rank update)
        return StableLoraConfig(r=64, target_modules="all-linear", use_svd=True, lora_dropout=0.0)
    raise ValueError(kind)


CASES = ("map", "sine", "svd")

"""Adapters: MAP, bounded sine and singular-value (SVD) adapters as PEFT LoRA variants, rsLoRA tooling,
training-free Bayesianisation.

```python
from hf_stable.adapters import StableLoraConfig, load_adapter, tfb_bayesianize, predict_bayes
config = StableLoraConfig(r=8, target_modules="all-linear", use_map=True)    # MAP (LoMAP)
config = StableLoraConfig(r=4096, target_modules="all-linear", use_svd=True)  # train the singular values only
trainer = StableSFTTrainer(model=model, args=args, train_dataset=ds, peft_config=config)
model = load_adapter(base_model, "out/checkpoint-100")                        # restores MAP/sine/SVD layers exactly
```
"""

from .config import StableLoraConfig
from .loading import check_adapter, load_adapter, merge_and_export
from .rslora import AdapterScaleCallback, lora_alpha_from_rslora, lora_scale, rank_sweep, rslora_alpha_from_lora
from .tfb import TfbSampler, predict_bayes, save_tfb, tfb_bayesianize, tfb_reparameterize


__all__ = [
    "AdapterScaleCallback",
    "StableLoraConfig",
    "TfbSampler",
    "check_adapter",
    "load_adapter",
    "lora_alpha_from_rslora",
    "lora_scale",
    "merge_and_export",
    "predict_bayes",
    "rank_sweep",
    "rslora_alpha_from_lora",
    "save_tfb",
    "tfb_bayesianize",
    "tfb_reparameterize",
]

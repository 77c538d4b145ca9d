"""Pure, torch-only loss functions registered by name (see `hf_stable.registry`). No transformers/trl imports."""

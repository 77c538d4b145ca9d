"""Known-harmless library messages that would otherwise open every `hf-stable` run on a newcomer's screen."""

from __future__ import annotations

import logging
import warnings


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_known_warnings() -> None:
    """Drop the messages below at their source; call it before transformers, peft or bitsandbytes are imported.

    * bitsandbytes (`bitsandbytes/backends/cpu/ops.py`, at import on CPUs with AVX512-BF16) tries to download an
      optional fused CPU 4-bit kernel from the Hub and logs "Failed to load CPU gemm_4bit_forward from
      kernels-community" when it cannot (offline, or the `kernels` package refuses an untrusted repository). It then
      uses its own CPU kernel, with the same results; nothing is lost but the message. Offline, the `kernels`
      package (`kernels/_internals/hf_hub.py`) first logs that it skips the publisher check of that same repository.

    Only these exact messages are dropped; every other warning of these libraries still shows.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community")
    )
    logging.getLogger("kernels._internals.hf_hub").addFilter(
        _DropMessage("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'")
    )
    # `accelerate launch` without an accelerate config lists the defaults it used (one process, no mixed precision,
    # no dynamo, one machine). hf-stable launches that way on purpose: the training config sets the precision
    # (`bf16`, `fp16`) and `--accelerate_config` / `--num_processes` the processes (docs/cli.md).
    logging.getLogger("accelerate.commands.launch").addFilter(
        _DropMessage("The following values were not passed to `accelerate launch` and had defaults used instead")
    )
    # transformers 5 renamed `gradient_checkpointing` to `activation_checkpointing`; TRL's configs still set the old
    # name as their default, so every TRL config built without the new name warns, whatever the user wrote.
    warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
    # and TRL's generation helper (`trl/models/utils.py`) reads the deprecated `model.is_gradient_checkpointing`
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

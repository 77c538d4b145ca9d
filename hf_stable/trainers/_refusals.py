"""What every hf_stable trainer refuses at construction, by name: settings that transformers accepts and then ignores,
so a run would end looking trained when it was not, or trained in another precision than asked."""

from __future__ import annotations


def refuse_unrunnable(args) -> None:
    """Raise `ValueError` for a `TrainingArguments` ``args`` that cannot run as written.

    - ``max_steps <= 0`` and ``num_train_epochs <= 0``: `Trainer` takes zero steps and saves the starting model as if
      trained. (``max_steps=-1`` with epochs > 0 is the ordinary epoch-based run.)
    - ``fp16=True`` on a CPU: transformers passes ``mixed_precision="fp16"`` to accelerate, whose `Accelerator` enables
      fp16 autocast and the GradScaler only when the device is not a CPU (``accelerate/accelerator.py``, the
      ``native_amp`` branch), so the run is plain fp32 and bitwise equal to ``fp16=False``. transformers refuses bf16
      on a device without it but never checks fp16. bf16 autocast does run on a CPU.
    """
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise ValueError(
            f"max_steps={args.max_steps} and num_train_epochs={args.num_train_epochs}: the run cannot take a step. "
            "Set `max_steps` > 0, or `num_train_epochs` > 0 with `max_steps=-1`."
        )
    if args.fp16 and args.device.type == "cpu":
        raise ValueError(
            "fp16=True has no effect on a CPU (accelerate runs fp16 mixed precision only on an accelerator; the run "
            "would be plain fp32). Use `bf16=True` (autocast runs on a CPU) or leave both off."
        )

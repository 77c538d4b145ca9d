"""The trainer seam of the loss modes that read more of the batch than the mode interface passes (``loss_mode="ess"``:
the reference and sampler log-probs, TRL's importance-sampling ratio). The modes themselves are pure torch, in
`hf_stable.losses`."""

from __future__ import annotations


class LossModeInputsMixin:
    """Mix into `StableGRPOTrainer` (before `GRPOTrainer` in the bases): a loss mode with ``bind_inputs`` sees the
    whole batch dict while ``compute_loss`` runs (the reference and sampler log-probs and TRL's importance-sampling
    ratio, which the mode interface does not pass), and its ``pop_metrics()`` are logged after it, averaged over
    processes."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = getattr(self, "_loss_mode", None)
        bind = getattr(mode, "bind_inputs", None)
        if bind is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        bind(inputs)
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            bind(None)
        split = "train" if self.model.training else "eval"
        for key, value in mode.pop_metrics().items():
            self._metrics[split][key].append(self.accelerator.gather(value.detach()).float().mean().item())
        return loss

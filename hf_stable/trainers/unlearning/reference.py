"""The starting model as a reference: NPO's `S_ref` (cached once), the reference distributions of the KL retain term
and of DMM's prior and precomputed targets.

The reference is, in order: a ``ref_model`` passed by the user; under PEFT, the model with its adapters disabled when
that gives the starting model (fresh adapters); otherwise a frozen copy of the starting model. `S_ref` is computed at
the first training step, after the model has been prepared (placed, wrapped), and saved in every checkpoint, so a
resumed run keeps the starting model's values.
"""

from __future__ import annotations

import copy

import torch

from ...losses import unlearning as L
from ...stability.nograd import own_forward  # one detection of foreign forwards, shared with NoGradientError
from .data import pad_stream
from .targets import shifted_logprobs


REF_LOGPS_KEY = "ref_seq_logps"  # checkpoint tensor


def frozen(model: torch.nn.Module, device) -> torch.nn.Module:
    return own_forward(model).to(device).eval().requires_grad_(False)


class ReferenceMixin:
    """Mixed into `UnlearningTrainer`: reads ``args``, ``model``, ``_is_peft`` and ``_forget_rows``."""

    _ref_model: torch.nn.Module | None
    _ref_seq_logps: torch.Tensor | None

    def _build_reference(self, ref_model) -> torch.nn.Module | None:
        """A frozen reference model, or ``None`` when none is needed or the adapter-free base serves."""
        args = self.args
        needed = (
            args.retain_loss_type == "kl"
            or (args.needs_reference_logps and not args.precompute_ref_logps)
            or (args.unlearn_method == "dmm" and args.dmm_target != "oracle_model")
        )
        if not needed:
            return None
        if ref_model is not None:
            return frozen(ref_model, args.device)
        if self._is_peft and self._adapters_are_identity():
            return None  # the adapter-free base is the starting model: `disable_adapter` gives it
        # a model whose adapters already act (a trained PeftModel passed in, a base-modifying init such as PiSSA):
        # the starting model is the adapted one, so copy it
        return frozen(copy.deepcopy(self.model), args.device)

    @torch.no_grad()
    def _adapters_are_identity(self) -> bool:
        """Whether the model with its adapters disabled gives the starting model's logits (fresh LoRA, MAP, sine)."""
        model = self.model
        stream = next(self._streams(self._forget_rows[:4], next(model.parameters()).device))
        was_training = model.training
        model.eval()
        try:
            adapted = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
            with model.disable_adapter():
                base = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
        finally:
            model.train(was_training)
        return torch.equal(adapted, base)

    @torch.no_grad()
    def _reference_logprobs(self, stream) -> torch.Tensor:
        """The starting model's shifted log-distributions `(B, T, V)` for a stream."""
        if self._ref_model is not None:
            return shifted_logprobs(self._ref_model, stream)
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with model.disable_adapter():
                return shifted_logprobs(model, stream)
        finally:
            model.train(was_training)

    def _reference_seq_logps(self, inputs, stream) -> torch.Tensor:
        """`S_ref (B,)` of the forget rows in ``stream``: from the cache, or from the reference model."""
        if self.args.precompute_ref_logps:
            if self._ref_seq_logps is None:
                self._ref_seq_logps = self._cache_reference_logps(stream["input_ids"].device)
            return self._ref_seq_logps.to(stream["input_ids"].device)[inputs["forget_index"]]
        logprobs = self._reference_logprobs(stream)
        picked = logprobs.gather(-1, stream["labels"][:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        mask = stream["labels"][:, 1:] != -100
        return torch.where(mask, picked, torch.zeros_like(picked)).sum(-1)

    @torch.no_grad()
    def _cache_reference_logps(self, device) -> torch.Tensor:
        """`S_ref` of every forget row under the starting model (before the first update), in eval mode."""
        model = self._ref_model if self._ref_model is not None else self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        out = []
        try:
            for stream in self._streams(self._forget_rows, device):
                logits = model(input_ids=stream["input_ids"], attention_mask=stream["attention_mask"]).logits
                logps, mask = L.token_logps(logits, stream["labels"])
                out.append(L.sequence_logps(logps, mask)[0])
        finally:
            model.train(was_training)
        return torch.cat(out)

    def _streams(self, rows, device, batch_size: int = 16):
        for start in range(0, len(rows), batch_size):
            stream = pad_stream(rows[start : start + batch_size], self.processing_class.pad_token_id)
            yield {key: value.to(device) for key, value in stream.items()}

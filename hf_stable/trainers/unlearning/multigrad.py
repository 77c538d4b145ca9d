"""Step-level multi-gradient unlearning, mixed into `UnlearningTrainer`: StableUN (Wu et al., arXiv 2509.20230; our
reconstruction) and SGA with the norm-minimising smoothing rate (arXiv 2510.22376; our reconstruction).

Both need several gradients of the *whole step* before combining them non-linearly (a projection, a rate), so the
trainer stashes the step's micro-batches and computes them at the last one. Each gradient is the sum over
micro-batches of step-normalised terms, summed over processes with an all-reduce: the combined update is then the
same for any accumulation or process layout. Gradients are taken with `torch.autograd.grad` on the unwrapped model
and written into ``p.grad`` for the optimizer, which is why fp16 loss scaling, DeepSpeed and FSDP are refused for
these schemes (`methods.MULTI_GRAD_HOSTS`).
"""

from __future__ import annotations

import torch

from ...losses import unlearning as L
from ...stability.signals import record_loss


class MultiGradMixin:
    """Mixed into `UnlearningTrainer`: uses its ``_forget_term``, ``_retain_term``, ``_forward``, ``_accumulate``
    and ``_step_counts``."""

    _pending: list[dict]

    def _multi_grad_step(self, model, inputs) -> torch.Tensor:
        """Stash the micro-batch; at the step's last one, compute the step's gradient and write it."""
        model.train()
        self._pending.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batches, self._pending = self._pending, []
        bare = self.accelerator.unwrap_model(model)
        params = [p for p in bare.parameters() if p.requires_grad]
        if self.args.scheme == "auto_rate":
            loss = self._auto_rate_gradient(bare, params, batches)
        else:
            loss = self._multipoint_gradient(bare, params, batches)
        self._end_step()
        loss = loss.detach().to(self.args.device)  # already the global value on every process
        # this step bypasses `Trainer.training_step`, where the signals mixin records the loss for the guard
        record_loss(self.state, loss, trainer=self)
        return loss

    def _flat_grad(self, params, batches, term) -> tuple[torch.Tensor, float]:
        """`Σ_batches ∇ term(batch)` flattened `(P,)` (fp32), all-reduced over processes, and the summed term value."""
        total = torch.zeros(sum(p.numel() for p in params), device=params[0].device, dtype=torch.float32)
        value = 0.0
        for batch in batches:
            loss = term(batch)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            total += torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                    for g, p in zip(grads, params, strict=True)
                ]
            )
            value += loss.detach().item()
        if self.accelerator.num_processes > 1:
            packed = torch.cat([total, total.new_tensor([value])])
            packed = self.accelerator.reduce(packed, reduction="sum")
            total, value = packed[:-1], packed[-1].item()
        return total, value

    def _flat_grad_at(self, params, offset: torch.Tensor, batches, term) -> tuple[torch.Tensor, float]:
        """`_flat_grad` at the probe point θ + ``offset``; the parameters are restored afterwards."""
        _shift(params, offset)
        try:
            return self._flat_grad(params, batches, term)
        finally:
            _shift(params, offset, -1.0)

    def _retain_off(self) -> bool:
        return self.args.retain_loss_type == "none" or self.args.retain_weight == 0

    def _retain_gradient(self, model, params, batches) -> tuple[torch.Tensor, float]:
        if self._retain_off():
            return torch.zeros(sum(p.numel() for p in params), device=params[0].device), 0.0
        return self._flat_grad(params, batches, lambda b: self._retain_term(model, b))

    def _combine(self, params, g_forget, g_retain, forget: float, retain: float) -> torch.Tensor:
        """Write the method's combination of the step gradients into ``p.grad``; return the combined step loss."""
        args = self.args
        kwargs = {"forget_weight": args.forget_weight, "retain_weight": args.retain_weight}
        kwargs.update(args.method.params_from(args))
        _write_grad(params, args.method({"forget": g_forget, "retain": g_retain}, **kwargs))
        return torch.tensor(args.method({"forget": forget, "retain": retain}, **kwargs))

    def _multipoint_gradient(self, model, params, batches) -> torch.Tensor:
        """StableUN: forgetting feedback at probe points around θ, remembering feedback at θ, projected when they
        conflict."""
        args = self.args

        def forget(b):
            return self._forget_term(model, b)[0]

        g0, f0 = self._flat_grad(params, batches, forget)
        probes = []
        if args.stableun_points in ("sam+clean", "sam+gauss"):
            probes.append(g0)
        g_sam, f_sam = self._flat_grad_at(params, L.sam_direction(g0, args.stableun_rho), batches, forget)
        probes.append(g_sam)
        if args.stableun_points == "sam+gauss":  # σ > 0 is guaranteed by the config
            generator = torch.Generator(device="cpu").manual_seed(args.seed + self.state.global_step)
            noise = torch.randn(g0.shape, generator=generator).to(g0.device) * args.stableun_sigma
            probes.append(self._flat_grad_at(params, noise, batches, forget)[0])
        g_forget = torch.stack(probes).mean(0)
        g_retain, r0 = self._retain_gradient(model, params, batches)
        cos = 0.0
        if args.stableun_project and not self._retain_off():
            g_forget, cos = L.project_conflicting(g_forget, g_retain)
        loss = self._combine(params, g_forget, g_retain, f0, r0)
        terms = {"forget_loss": f0, "retain_loss": r0, "forget_loss_sam": f_sam, "proj_cos": cos}
        self._accumulate({key: torch.tensor(v) for key, v in terms.items()}, {}, reduced=True)
        return loss

    def _auto_rate_gradient(self, model, params, batches) -> torch.Tensor:
        """SGA with `r* = argmin ‖g_f + r v‖` clipped to ``sga_rate_range``; the step uses r* for its update."""
        args = self.args
        k = args.sga_num_normal + 1

        def forget_nll(b):  # mean forget NLL over the step's forget sequences
            _, logps, mask = self._forward(model, b["forget"])
            return L.mean_nll(logps, mask).sum() / self._step_counts["forget_sequence"]

        def normal_nll(b):  # mean NLL over the step's normal sequences
            n = {key: value.flatten(0, 1) for key, value in b["normal"].items()}
            _, logps, mask = self._forward(model, n)
            return L.mean_nll(logps, mask).sum() / self._step_counts["normal_sequence"]

        g_f, f_nll = self._flat_grad(params, batches, forget_nll)
        g_n, n_nll = self._flat_grad(params, batches, normal_nll)
        low, high = args.sga_rate_range
        rate = L.sga_auto_rate(g_f, g_n, k, low, high)
        w_f, w_n = L.sga_weights(rate, k)
        # L = −w_f·mean ℓ̄_f − w_n·Σ_k ℓ̄_{n_k} per forget example = −w_f·F̄ − w_n·(k−1)·N̄
        g_sga = -w_f * g_f - w_n * (k - 1) * g_n
        g_retain, r0 = self._retain_gradient(model, params, batches)
        forget_value = -w_f * f_nll - w_n * (k - 1) * n_nll
        loss = self._combine(params, g_sga, g_retain, forget_value, r0)
        terms = {"forget_loss": forget_value, "retain_loss": r0, "sga_rate": rate}
        self._accumulate({key: torch.tensor(v) for key, v in terms.items()}, {}, reduced=True)
        return loss


@torch.no_grad()
def _shift(params, offset: torch.Tensor, sign: float = 1.0) -> None:
    start = 0
    for p in params:
        n = p.numel()
        p.add_(offset[start : start + n].view_as(p).to(p.dtype), alpha=sign)
        start += n


@torch.no_grad()
def _write_grad(params, flat: torch.Tensor) -> None:
    start = 0
    for p in params:
        n = p.numel()
        g = flat[start : start + n].view_as(p).to(p.dtype)
        p.grad = g.clone() if p.grad is None else p.grad + g
        start += n

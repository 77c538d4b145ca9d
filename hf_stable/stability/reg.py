"""REG: row-and-column scaled momentum for matrix parameters, AdamW for the rest (reconstructed from arXiv 2510.03691).

For a 2-D parameter ``W`` (m, n) with gradient ``G``:

* momentum ``M ← μM + G``; Nesterov direction ``N = G + μM`` (plain ``N = M`` with ``nesterov=False``); μ = 0.95;
* RACS (row-and-column scaling): ``rᵢ = sqrt(mean_j N_ij²)``, ``c_j = sqrt(mean_i N_ij²)``,
  ``U_ij = N_ij / sqrt((rᵢ + ε)(c_j + ε))``; ``racs_iters = k > 1`` repeats the balancing on ``U``
  (Sinkhorn-style), which drives every row and every column of ``U`` to the same RMS. For a rank-1 ``N`` one pass
  gives a sign pattern, as ``msign`` would; in general it is gentler than the orthogonalisation of Muon;
* RMS matching: ``U ← U · rms_target / (RMS(U) + ε)`` (default 0.2), so the step size is comparable to AdamW's and
  AdamW-tuned learning rates carry over;
* decoupled weight decay and step: ``W ← W − lr·(U + wd·W)`` (wd = 0.1, as ``torch.optim.Muon``).

Every other parameter (embeddings, norms, biases: anything not 2-D, or a group with ``use_reg=False``) gets AdamW
with ``adamw_betas``/``adamw_eps`` and the group's ``weight_decay``. The operator and constants are our reading of the
abstract and a third-party summary: this is an experimental optimizer. State is plain tensors (``momentum_buffer``,
``exp_avg``, ``exp_avg_sq``, ``step``), so HF checkpoints and the stability guard's snapshots work.

Pure torch.
"""

from __future__ import annotations

import torch


__all__ = ["REG", "racs"]


def racs(n: torch.Tensor, iters: int = 1, eps: float = 1e-8) -> torch.Tensor:
    """Row-and-column scaling of a (m, n) matrix, ``iters`` passes (fp32)."""
    u = n.float()
    for _ in range(int(iters)):
        rows = u.pow(2).mean(dim=1, keepdim=True).sqrt()
        cols = u.pow(2).mean(dim=0, keepdim=True).sqrt()
        u = u / ((rows + eps) * (cols + eps)).sqrt()
    return u


class REG(torch.optim.Optimizer):
    """See the module docstring. ``params``: parameters or param groups (a group may set ``use_reg``)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        rms_target: float = 0.2,
        racs_iters: int = 1,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        eps: float = 1e-8,
    ):
        from .._validation import check_int, check_number

        check_number("lr", lr, low=0)
        check_number("momentum", momentum, low=0, high=1, high_open=True)
        check_number("weight_decay", weight_decay, low=0)
        check_number("rms_target", rms_target, low=0, low_open=True)
        check_int("racs_iters", racs_iters, low=1)
        for i, beta in enumerate(adamw_betas):
            check_number(f"adamw_betas[{i}]", beta, low=0, high=1, high_open=True)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            rms_target=rms_target,
            racs_iters=racs_iters,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            eps=eps,
            use_reg=True,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_reg"] and p.ndim == 2:
                    self._reg_step(p, group)
                else:
                    self._adamw_step(p, group)
        return loss

    def _reg_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        grad = p.grad.float()
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(grad)
        direction = grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        u = racs(direction, group["racs_iters"], group["eps"])
        rms = u.pow(2).mean().sqrt()
        u = u * (group["rms_target"] / (rms + group["eps"]))
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(u.to(p.dtype), alpha=-group["lr"])

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        beta1, beta2 = group["adamw_betas"]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        grad = p.grad
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        bias1 = 1.0 - beta1**step
        bias2 = 1.0 - beta2**step
        denom = (state["exp_avg_sq"].sqrt() / bias2**0.5).add_(group["adamw_eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)

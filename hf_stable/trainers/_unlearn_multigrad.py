"""Step-level multi-gradient unlearning: StableUN (Wu et al., arXiv 2509.20230; our reconstruction) and SGA with the
norm-minimising smoothing rate (arXiv 2510.22376; our reconstruction).

Both need several gradients of the *whole step* before combining them non-linearly (a projection, a rate), so the
trainer stashes the step's micro-batches and calls `multi_grad_step` at the last one. Each gradient is the sum over
micro-batches of step-normalised terms, summed over processes with an all-reduce: the combined update is then the
same for any accumulation or process layout. Gradients are taken with `torch.autograd.grad` on the unwrapped model
(full-parameter gradients: DDP and single device; not ZeRO-3/FSDP) and written into ``p.grad`` for the optimizer.
"""

from __future__ import annotations

import torch

from ..losses import unlearning as L


def _flat_grad(trainer, params, batches, term) -> tuple[torch.Tensor, float]:
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
    if trainer.accelerator.num_processes > 1:
        packed = torch.cat([total, total.new_tensor([value])])
        packed = trainer.accelerator.reduce(packed, reduction="sum")
        total, value = packed[:-1], packed[-1].item()
    return total, value


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


def multi_grad_step(trainer, model, batches: list[dict]) -> torch.Tensor:
    """Compute and write the step's gradient; returns the step's (global) loss for logging."""
    params = [p for p in model.parameters() if p.requires_grad]
    args = trainer.args
    if args.unlearn_method == "sga":
        return _sga_auto(trainer, model, params, batches)
    return _stableun(trainer, model, params, batches)


def _retain(trainer, model, params, batches):
    if args_retain_off(trainer):
        return torch.zeros(sum(p.numel() for p in params), device=params[0].device), 0.0
    return _flat_grad(trainer, params, batches, lambda b: trainer._retain_term(model, b))


def args_retain_off(trainer) -> bool:
    return trainer.args.retain_loss_type == "none" or trainer.args.retain_weight == 0


def _stableun(trainer, model, params, batches) -> torch.Tensor:
    """Forgetting feedback at probe points around θ, remembering feedback at θ, projected when they conflict."""
    args = trainer.args

    def forget(b):
        return trainer._forget_term(model, b)[0]

    g0, f0 = _flat_grad(trainer, params, batches, forget)
    probes, values = [], []
    if args.stableun_points in ("sam+clean", "sam+gauss"):
        probes.append(g0)
        values.append(f0)
    offset = L.sam_direction(g0, args.stableun_rho)
    _shift(params, offset)
    try:
        g_sam, f_sam = _flat_grad(trainer, params, batches, forget)
    finally:
        _shift(params, offset, -1.0)
    probes.append(g_sam)
    values.append(f_sam)
    if args.stableun_points == "sam+gauss" and args.stableun_sigma > 0:
        generator = torch.Generator(device="cpu").manual_seed(args.seed + trainer.state.global_step)
        noise = torch.randn(g0.shape, generator=generator).to(g0.device) * args.stableun_sigma
        _shift(params, noise)
        try:
            g_gauss, f_gauss = _flat_grad(trainer, params, batches, forget)
        finally:
            _shift(params, noise, -1.0)
        probes.append(g_gauss)
        values.append(f_gauss)
    g_forget = torch.stack(probes).mean(0)
    g_retain, r0 = _retain(trainer, model, params, batches)
    cos = 0.0
    if args.stableun_project and not args_retain_off(trainer):
        g_forget, cos = L.project_conflicting(g_forget, g_retain)
    _write_grad(params, args.forget_weight * g_forget + args.retain_weight * g_retain)
    trainer._accumulate(
        {
            "forget_loss": torch.tensor(f0),
            "retain_loss": torch.tensor(r0),
            "forget_loss_sam": torch.tensor(f_sam),
            "proj_cos": torch.tensor(cos),
        },
        {},
    )
    _unshare_reduced(trainer, ("forget_loss", "retain_loss", "forget_loss_sam", "proj_cos"))
    return torch.tensor(args.forget_weight * f0 + args.retain_weight * r0)


def _sga_auto(trainer, model, params, batches) -> torch.Tensor:
    """SGA with `r* = argmin ‖g_f + r v‖` clipped to ``sga_rate_range``; the step uses r* for its update."""
    args = trainer.args
    k = args.sga_num_normal + 1

    def forget_nll(b):  # mean forget NLL over the step's forget sequences
        _, logps, mask = trainer._forward(model, b["forget"])
        return L.mean_nll(logps, mask).sum() / trainer._step_counts["forget_sequence"]

    def normal_nll(b):  # mean NLL over the step's normal sequences
        n = {key: value.flatten(0, 1) for key, value in b["normal"].items()}
        _, logps, mask = trainer._forward(model, n)
        return L.mean_nll(logps, mask).sum() / trainer._step_counts["normal_sequence"]

    g_f, f_nll = _flat_grad(trainer, params, batches, forget_nll)
    g_n, n_nll = _flat_grad(trainer, params, batches, normal_nll)
    low, high = args.sga_rate_range
    rate = L.sga_auto_rate(g_f, g_n, k, low, high)
    w_f, w_n = L.sga_weights(rate, k)
    # L = −w_f·mean ℓ̄_f − w_n·Σ_k ℓ̄_{n_k} per forget example = −w_f·F̄ − w_n·(k−1)·N̄
    g_sga = -w_f * g_f - w_n * (k - 1) * g_n
    g_retain, r0 = _retain(trainer, model, params, batches)
    _write_grad(params, args.forget_weight * g_sga + args.retain_weight * g_retain)
    forget_value = -w_f * f_nll - w_n * (k - 1) * n_nll
    trainer._accumulate(
        {"forget_loss": torch.tensor(forget_value), "retain_loss": torch.tensor(r0), "sga_rate": torch.tensor(rate)},
        {},
    )
    _unshare_reduced(trainer, ("forget_loss", "retain_loss", "sga_rate"))
    return torch.tensor(args.forget_weight * forget_value + args.retain_weight * r0)


def _unshare_reduced(trainer, keys) -> None:
    """These values are already global (all-reduced); `_end_step` sums over processes, so keep one share each."""
    n = trainer.accelerator.num_processes
    for key in keys:
        trainer._step_sums[key] = trainer._step_sums[key] / n

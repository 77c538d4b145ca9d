"""Jacobian descent in `StableGRPOTrainer` (`gradient_aggregation="upgrad"` or `"aligned_mtl"`;
`hf_stable.losses.jacobian` has the maths and the papers).

Per generation batch the per-reward parts of TRL's advantage ([`reward_advantage_parts`], `(N, K)`) travel with the
batch as ``reward_advantages``. Each micro-batch runs one forward and K backwards of TRL's own loss, one per reward
column, and adds the gradients into the fp32 Jacobian `(K, n)` over the `n` trainable parameters; the loss handed
back to the `Trainer` is a detached leaf, so its backward adds nothing to the parameters. At the last micro-batch of
the optimizer step the aggregated update is written into `.grad`, before gradient clipping and the optimizer.

Memory: `K × n × 4` bytes for the Jacobian plus one gradient's worth while a row is added; refused above
`jacobian_max_bytes`. Refused by name at construction: fewer than two reward functions, several processes (DDP: the
rows are not all-reduced), DeepSpeed and FSDP (sharded gradients), fp16 (the GradScaler scales the loss the Jacobian
bypasses), negative `reward_weights`, TRL's entropy bonus and MoE auxiliary loss (no reward's term).
"""

from __future__ import annotations

import torch

from ..losses.jacobian import GRADIENT_AGGREGATIONS, aggregate, jacobian_bytes, reward_advantage_parts


KEY = "reward_advantages"


class JacobianDescentMixin:
    """Adds the `gradient_aggregation` aggregators to a GRPO trainer; inert under the default `"sum"`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jacobian: torch.Tensor | None = None
        method = GRADIENT_AGGREGATIONS.active(self.args)
        if method is None:
            return
        self._jacobian_params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self._jacobian_params)
        self._refuse_jacobian(method.name, len(self.reward_funcs), n)
        self._jacobian = torch.zeros(len(self.reward_funcs), n, device=self._jacobian_params[0].device)

    def _refuse_jacobian(self, name: str, k: int, n: int) -> None:
        where = f"gradient_aggregation={name!r}"
        size = jacobian_bytes(k, n)
        problems = []
        if k < 2:
            problems.append(f"it needs at least 2 reward functions, got {k} (`reward_funcs`)")
        if self.accelerator.num_processes > 1:
            problems.append(
                f"{self.accelerator.num_processes} processes (DDP): the Jacobian rows are not all-reduced; run on one"
            )
        if self.args.n_gpu > 1:
            problems.append(f"n_gpu={self.args.n_gpu} (DataParallel): the replicas' rows are not reduced; use one GPU")
        if self.is_deepspeed_enabled:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            problems.append(f"DeepSpeed ZeRO-{stage} (`deepspeed`): it owns and shards the gradients")
        if self.is_fsdp_enabled:
            problems.append("FSDP (`fsdp`): the gradients are sharded")
        if self.args.fp16:
            problems.append("fp16=True: the GradScaler scales a loss the Jacobian bypasses; use bf16")
        if (self.reward_weights < 0).any():
            problems.append(f"`reward_weights`={self.reward_weights.tolist()} must be >= 0 (weights of the rows)")
        if self.aux_loss_enabled:
            problems.append("the MoE auxiliary loss (`router_aux_loss_coef` != 0) is no reward's")
        if size > self.args.jacobian_max_bytes:
            problems.append(
                f"its Jacobian needs {size} bytes ({k} reward functions × {n} trainable parameters × 4), above "
                f"`jacobian_max_bytes`={self.args.jacobian_max_bytes}: train fewer parameters (LoRA) or raise it"
            )
        if problems:
            raise ValueError(f"{where} cannot run: {'; '.join(problems)}.")

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self._jacobian is not None and self.model.training:
            parts = reward_advantage_parts(
                self._stash_rewards, self.reward_weights, self.num_generations, self.args.scale_rewards
            )
            start = self.accelerator.process_index * len(inputs)
            out[KEY] = parts[start : start + len(inputs)].to(out["advantages"].device)
        return out

    def _compute_loss(self, model, inputs):
        if self._jacobian is None or KEY not in inputs or not self.model.training:
            return super()._compute_loss(model, inputs)
        columns = inputs[KEY]
        forward, cached = self._get_per_token_logps_and_entropies, []

        def forward_once(*args, **kwargs):  # the K losses share one forward (and its graph)
            if not cached:
                cached.append(forward(*args, **kwargs))
            return cached[0]

        self._get_per_token_logps_and_entropies = forward_once
        total = torch.zeros((), device=columns.device)
        try:
            k = columns.shape[1]
            for i in range(k):
                loss = super()._compute_loss(model, {**inputs, "advantages": columns[:, i]})
                grads = torch.autograd.grad(loss, self._jacobian_params, retain_graph=i < k - 1, allow_unused=True)
                offset = 0
                for g, p in zip(grads, self._jacobian_params, strict=True):
                    if g is not None:
                        self._jacobian[i, offset : offset + p.numel()] += g.reshape(-1).float()
                    offset += p.numel()
                total = total + self.reward_weights[i].to(total) * loss.detach()
        finally:
            del self._get_per_token_logps_and_entropies  # the class's method again
        # a leaf: the Trainer's backward of it touches no parameter
        return total.requires_grad_()

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._jacobian is not None and self.accelerator.sync_gradients:
            update = aggregate(self._jacobian, self.reward_weights, self.args.gradient_aggregation)
            offset = 0
            for p in self._jacobian_params:
                p.grad = update[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
                offset += p.numel()
            self._jacobian.zero_()
        return loss

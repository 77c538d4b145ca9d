"""SR-GRPO's intrinsic reward: the stable rank of a response's hidden states (Tang & Yang, arXiv 2512.02807).

`SR(H) = ||H||_F² / ||H||_2²` of the final-layer hidden states `H (T, d)` at the response positions: total variance
over the variance along the dominant direction, in `[1, min(T, d)]`. Repetitive, collapsed text scores near 1. Which
layer, which model and which tokens are our choices (no author code is public); they are arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._validation import boolean, choice, number
from ..papers import PAPERS
from ..registry import Field, Registry


# A switch: `stable_rank_reward=True` appends the model's own reward to `reward_funcs`.
INTRINSIC_REWARDS = Registry(
    "intrinsic_reward",
    "rewards computed from the model's own hidden states, appended to the reward functions",
    selector="stable_rank_reward",
    enable=True,
    selector_check=boolean(),
)


def stable_rank(hidden: torch.Tensor, center: bool = False, eps: float = 1e-12) -> torch.Tensor:
    """Stable rank of ``hidden`` `(T, d)` (or a batch `(..., T, d)`), in fp32 via the smaller Gram matrix.

    Returns `||H||_F² / λ_max(G)` with `G = H Hᵀ` (T < d) or `Hᵀ H`; 1 for a rank-one matrix, `min(T, d)` for
    orthonormal rows, 0 for an all-zero matrix.
    """
    h = hidden.float()
    if center:
        h = h - h.mean(dim=-2, keepdim=True)
    gram = h @ h.transpose(-1, -2) if h.shape[-2] < h.shape[-1] else h.transpose(-1, -2) @ h
    frob2 = (h * h).sum(dim=(-2, -1))
    top = torch.linalg.eigvalsh(gram)[..., -1].clamp(min=0)
    return torch.where(top > eps, frob2 / top.clamp(min=eps), torch.zeros_like(frob2))


NORMALIZATIONS = ("none", "by_T", "log")
HIDDEN_STATES = ("before_norm", "after_norm")


def final_norm(model) -> torch.nn.Module:
    """The norm applied to the last decoder layer's output (`norm`, `final_layernorm` or `ln_f` of the decoder)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    for name in ("norm", "final_layernorm", "ln_f"):
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(
        f"`stable_rank_hidden`: {type(base).__name__} has no final norm (`norm`, `final_layernorm` or `ln_f`) to "
        "read the hidden states around."
    )


class StableRankReward:
    """A TRL reward function scoring each completion by the stable rank of its hidden states.

    A plain callable, not an `nn.Module`: TRL treats module rewards as sequence classifiers. It tokenises the prompt
    as TRL's generation did (the trainer's `_tokenize_prompts` once bound; otherwise the tokenizer with its default
    special tokens, or the chat template for conversational prompts), runs the scoring model without gradients, and
    takes the last layer's hidden states at the completion tokens.

    Args:
        model: the scoring model, e.g. a frozen copy of the initial policy (so the policy cannot game its own
            geometry) or the policy itself.
        tokenizer: its tokenizer.
        hidden (`str`, defaults to `"before_norm"`): the last decoder layer's output before the final norm (the
            paper's reading of the final hidden states) or `"after_norm"` (what the LM head sees).
        center (`bool`, defaults to `False`): centre the hidden states first (a PCA-style reading).
        normalize (`str`, defaults to `"none"`): `"none"`, `"by_T"` (`SR / min(T, d)`, removes the length advantage)
            or `"log"`.
        batch_size (`int`, defaults to `16`): completions per forward.

    Returns, when called: one float per completion; `None` (TRL's "not applicable") for an empty completion.
    """

    def __init__(
        self,
        model,
        tokenizer,
        hidden: str = "before_norm",
        center: bool = False,
        normalize: str = "none",
        batch_size: int = 16,
    ):
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be 'none', 'by_T' or 'log', got {normalize!r}.")
        if hidden not in HIDDEN_STATES:
            raise ValueError(f"hidden must be 'before_norm' or 'after_norm', got {hidden!r}.")
        self.model, self.tokenizer = model, tokenizer
        self.hidden, self.center, self.normalize, self.batch_size = hidden, center, normalize, batch_size
        self._tokenize_prompts = None
        self.__name__ = "stable_rank"  # TRL names reward columns after __name__

    def _prompt_ids(self, prompts) -> list[list[int]]:
        if self._tokenize_prompts is not None:
            return [list(ids) for ids in self._tokenize_prompts(list(prompts))[0]]
        if isinstance(prompts[0], str):
            return self.tokenizer(list(prompts))["input_ids"]
        return [
            self.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            for p in prompts
        ]

    def _hidden_states(self, ids, mask) -> torch.Tensor:
        captured = {}

        def keep(module, inputs, output):
            captured["before_norm"], captured["after_norm"] = inputs[0], output

        hook = final_norm(self.model).register_forward_hook(keep)
        try:
            self.model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        finally:
            hook.remove()
        return captured[self.hidden]

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
        if completion_ids is None:
            completion_ids = [
                self.tokenizer(c if isinstance(c, str) else c[-1]["content"], add_special_tokens=False)["input_ids"]
                for c in completions
            ]
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores: list[float | None] = []
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(prompts), self.batch_size):
            batch = slice(start, start + self.batch_size)
            rows = [
                (list(p), list(c))
                for p, c in zip(self._prompt_ids(prompts[batch]), completion_ids[batch], strict=True)
            ]
            width = max(len(p) + len(c) for p, c in rows)
            ids = torch.tensor([p + c + [pad] * (width - len(p) - len(c)) for p, c in rows], device=device)
            mask = torch.tensor(
                [[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c in rows], device=device
            )
            hidden = self._hidden_states(ids, mask)
            for row, (p, c) in enumerate(rows):
                if not c:
                    scores.append(None)
                    continue
                h = hidden[row, len(p) : len(p) + len(c)]
                sr = stable_rank(h, center=self.center).item()
                if self.normalize == "by_T":
                    sr /= min(h.shape)
                elif self.normalize == "log":
                    sr = float(torch.log(torch.tensor(max(sr, 1e-12))))
                scores.append(sr)
        self.model.train(was_training)
        return scores

    def bind(self, trainer) -> None:
        """Attach to a built trainer: its tokenizer and prompt tokenisation, and the trained model when no separate
        scorer was given."""
        self.tokenizer = trainer.processing_class
        self._tokenize_prompts = trainer._tokenize_prompts
        if self.model is None:
            self.model = trainer.accelerator.unwrap_model(trainer.model)
        else:
            self.model.requires_grad_(False).eval().to(trainer.accelerator.device)


@INTRINSIC_REWARDS.register(
    "stable_rank",
    paper=PAPERS["sr_grpo"],
    description="stable rank of the response's hidden states (SR-GRPO)",
    fields=[
        Field("stable_rank_weight", 1.0, "Reward weight of the stable-rank reward.", check=number(), param="weight"),
        Field(
            "stable_rank_model",
            "ref",
            '`"ref"` (a frozen copy of the initial policy scores, so the policy cannot game its own geometry) or '
            '`"policy"`.',
            check=choice("ref", "policy"),
            param="scorer",
        ),
        Field(
            "stable_rank_normalize",
            "none",
            '`"none"` (SR in [1, min(T, d)], which grows with the length T), `"by_T"` (SR / min(T, d)) or `"log"`.',
            check=choice(*NORMALIZATIONS),
            param="normalize",
        ),
        Field(
            "stable_rank_hidden",
            "before_norm",
            'Hidden states of the last layer `"before_norm"` (the final norm) or `"after_norm"`.',
            check=choice(*HIDDEN_STATES),
            param="hidden",
        ),
    ],
)
def stable_rank_reward(
    load_reference: Callable,
    weight: float = 1.0,
    scorer: str = "ref",
    normalize: str = "none",
    hidden: str = "before_norm",
) -> StableRankReward:
    """The reward a trainer appends: scored by ``load_reference()`` (a frozen copy of the initial policy, made before
    the trainer wraps the model) or, with ``scorer="policy"``, by the trained model once bound; ``weight`` is its
    reward weight."""
    reward = StableRankReward(load_reference() if scorer == "ref" else None, None, hidden=hidden, normalize=normalize)
    reward.weight = weight
    return reward

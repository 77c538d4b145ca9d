"""The exact-match verifier of the synthetic arithmetic task (`hf_stable.testing.arithmetic_dataset`), registered as
the reward function ``arithmetic_exact_match``. It lives here, not with the task, because the library may not import
the test fixtures."""

from __future__ import annotations


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content", "")
    raise TypeError(f"A completion must be a string or a list of chat messages, got {type(completion).__name__}.")


def arithmetic_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """Exact-match verifier usable as a TRL reward function: 1.0 when the stripped completion equals ``answer``.

    Accepts standard (strings) and conversational (lists of messages) completions; extra dataset columns arrive as
    keyword arguments and are ignored.
    """
    return [
        1.0 if _completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)
    ]

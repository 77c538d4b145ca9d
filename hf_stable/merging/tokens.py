"""The `tokenizer:` block of a recipe, as mergekit 0.1.5 defines it (`tokenizer/config.py`: `TokenizerConfig`,
`TokenEmbeddingConfig`, `ModelTokenEmbedding`, `ZeroEmbedding`):

    tokenizer:
      source: union | base | <model>      # default union
      pad_to_multiple_of: 64              # the vocabulary axis rounded up; the new rows are each model's mean row
      tokens:
        <token>: {source: <model>, force: false}
        <token>: {source: {kind: model_token, model: <model>, token: <token>}}   # or token_id: <int>
        <token>: {source: {kind: zero}}

A token named under `tokens:` that the output tokenizer lacks is added to it. Its source fills the rows of the models
that lack the token (`force: true`: of every model). How the rows are filled: `vocab.fill_rows`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .model_refs import ModelRef


@dataclasses.dataclass(frozen=True)
class TokenEmbedding:
    """Where a token's row comes from.

    Attributes:
        kind: `"model"` (the model's own row of the token), `"model_token"` (a row of the model's own vocabulary, by
            token or id), `"zero"`, or None (no source: only valid where every model has the token and nothing is
            forced, as in mergekit).
        model: the model (`"model"`, `"model_token"`).
        token / token_id: the source row of `"model_token"` (exactly one).
        force: fill the row in every model, the ones that have the token too.
    """

    kind: str | None = None
    model: ModelRef | None = None
    token: str | None = None
    token_id: int | None = None
    force: bool = False

    def to_dict(self, name=lambda s: s) -> dict:
        d: dict[str, Any] = {}
        if self.kind == "model":
            d["source"] = name(self.model.spec)
        elif self.kind == "zero":
            d["source"] = {"kind": "zero"}
        elif self.kind == "model_token":
            src: dict[str, Any] = {"kind": "model_token", "model": name(self.model.spec)}
            src.update({"token": self.token} if self.token is not None else {"token_id": self.token_id})
            d["source"] = src
        if self.force:
            d["force"] = True
        return d


def parse_token(spec: Any, where: str) -> TokenEmbedding:
    """One entry of `tokenizer.tokens` (`TokenEmbedding` or its recipe form); `ValueError` naming the field."""
    if isinstance(spec, TokenEmbedding):
        return spec
    if spec is None:
        spec = {}
    if not isinstance(spec, dict) or set(spec) - {"source", "force"}:
        raise ValueError(f"{where}: expected {{source: ..., force: true|false}}, got {spec!r}")
    force = spec.get("force", False)
    if not isinstance(force, bool):
        raise ValueError(f"{where}.force must be true or false, got {force!r}")
    source = spec.get("source")
    if source is None:
        return TokenEmbedding(force=force)
    if isinstance(source, str):
        return TokenEmbedding("model", ModelRef.parse(source, f"{where}.source"), force=force)
    if not isinstance(source, dict) or source.get("kind") not in ("model_token", "zero"):
        raise ValueError(f"{where}.source: a model, {{kind: zero}} or {{kind: model_token, model: ..., token: ...}} "
                         f"(or token_id), got {source!r}")  # fmt: skip
    if source["kind"] == "zero":
        if set(source) != {"kind"}:
            raise ValueError(f"{where}.source: {{kind: zero}} takes no other key, got {source!r}")
        return TokenEmbedding("zero", force=force)
    if set(source) - {"kind", "model", "token", "token_id"} or "model" not in source:
        raise ValueError(f"{where}.source: {{kind: model_token, model: ..., token: ...}} (or token_id), "
                         f"got {source!r}")
    token, token_id = source.get("token"), source.get("token_id")
    if (token is None) == (token_id is None):
        raise ValueError(f"{where}.source: give exactly one of token or token_id, got {source!r}")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{where}.source.token must be a string, got {token!r}")
    if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool)):
        raise ValueError(f"{where}.source.token_id must be an integer, got {token_id!r}")
    model = ModelRef.parse(source["model"], f"{where}.source.model")
    return TokenEmbedding("model_token", model, token, token_id, force)


def parse_tokens(tokens: Any, where: str = "tokenizer.tokens") -> dict[str, TokenEmbedding] | None:
    """`tokenizer.tokens`: `{token: TokenEmbedding}`, None when empty or absent."""
    if tokens is None:
        return None
    if not isinstance(tokens, dict) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where} must map token strings to {{source: ..., force: ...}}, got {tokens!r}")
    return {t: parse_token(v, f"{where}[{t!r}]") for t, v in tokens.items()} or None


def parse_pad(value: Any, where: str = "tokenizer.pad_to_multiple_of") -> int | None:
    """`pad_to_multiple_of`: a positive integer, or None (0 and null: no padding, as in mergekit)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return value


def padded(size: int, multiple: int | None) -> int:
    """`size` rounded up to a multiple of `multiple` (mergekit's `PermutedVocabulary` / `_update_config_vocab`)."""
    if not multiple or size % multiple == 0:
        return size
    return (size // multiple + 1) * multiple


__all__ = ["TokenEmbedding", "padded", "parse_pad", "parse_token", "parse_tokens"]

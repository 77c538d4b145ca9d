"""`tokenizer_source`: the output vocabulary and each model's vocabulary rows moved into it, as mergekit 0.1.5 does it
(behaviour followed: `tokenizer/build.py` `get_stripped_tokenizer`, `build_union_tokenizer`,
`build_tokenizer`; `tokenizer/embed.py` `PermutedVocabulary`; `plan.py`, which sends every tensor with a vocabulary
axis through it before the merge method; `merge.py` `_update_config_vocab`).

The output tokenizer: with `base`, the base model's (the first model's without `base_model`), stripped of the tokens
at ids `≥ vocab_size` of its `config.json`; with a model, that model's; with `union`, the stripped base tokenizer
and then, model by model (the base first, then the recipe's models in order), every
token below that model's `vocab_size` that the tokenizer lacks is added (`add_tokens`), plain tokens first, then the
models' added tokens with their settings (the first model's settings win).

Each input tensor with a vocabulary axis (`VOCAB_TENSORS`, axis 0: the input embedding and `lm_head`) becomes a
`(V, ...)` tensor over the output's `V` tokens: a token the model has keeps its row; a token some model lacks gets,
in the models that lack it, the row of its only holder, else the base's row when the base is among the tensor's
models and has it, else the mean of the holders' rows (summed in model order and divided, in the tensor's
arithmetic dtype), else zeros. Rows of the model past the tokenizer's tokens (padding) are dropped. The merge method
then runs on these tensors as on any others, so every method merges them as mergekit does. The tensor's models are
the recipe's models and the base (`models:`), or the sources of the first slice (embedding) or the last (`lm_head`).
When every model already has the output vocabulary, row for row, the tensors are read as they are.

The arithmetic dtype is mergekit's: inputs are cast to the recipe's `dtype` when they are read, else promoted to
their common dtype; with `fp32_arithmetic: true` the rows are filled in float32 and rounded once to the inputs'
common dtype. The aligned tensors are held in memory for the merge (outside `memory_budget`).

Where mergekit orders by an unordered set (its non-base models when it builds the union, and the model whose
tokenizer is the base when there is no `base_model`), this follows the recipe's order: the same union whenever the
models' added tokens come in compatible orders. mergekit fails, and so does this (`ValueError`, before anything is
written), when an output token sits past a model's `vocab_size` in that model's tokenizer, and, with `union`, when
the base's tokenizer cannot be loaded or stripping needs a tokenizer that is not a fast BPE one (with `base` or a
model, the tokenizer files are then copied as they are, as before). An output embedding (`lm_head`) missing from
some models only (saved with tied embeddings) is, in those models, their input embedding, as mergekit reads it
(its architectures' `tied_names`): aligned and merged with the others' `lm_head`, and written.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from .compat import TIED_OUTPUT_NAMES, VOCAB_TENSORS, tied_input
from .io.dtypes import torch_dtypes
from .io.header import ModelCheckpoint, TensorInfo
from .resolve import resolve_model_path
from .settings import is_pre_layer
from .tokens import padded


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False, use_fast=True)


def config_vocab_size(path: str) -> int | None:
    """`vocab_size` of a model's `config.json` (top level, else `text_config`), or None."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def _stripped(tok, size: int, label: str):
    """The base tokenizer without its tokens at ids `≥ size` (mergekit: `get_stripped_tokenizer`)."""
    unused = {t for t, i in tok.get_vocab().items() if i >= size}
    if not unused:
        return tok
    import tokenizers

    if not tok.is_fast:
        raise ValueError(f"model {label!r} lists tokens past its vocab_size ({size}) and has no fast tokenizer to "
                         "strip them from (mergekit 0.1.5 refuses it too)")  # fmt: skip
    data = json.loads(tok._tokenizer.to_str())
    if data["model"]["type"] != "BPE":
        raise ValueError(
            f"model {label!r} lists tokens past its vocab_size ({size}) in a {data['model']['type']} tokenizer; only "
            "BPE tokenizers can be stripped (as in mergekit 0.1.5)"
        )
    data["added_tokens"] = [e for e in data["added_tokens"] if e["id"] < size]
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if t not in unused}

    def keep(merge) -> bool:
        parts = merge.split(" ") if isinstance(merge, str) else merge
        return not any(p in unused for p in parts)

    data["model"]["merges"] = [m for m in data["model"]["merges"] if keep(m)]
    tok._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(data))
    return tok


def _union(base_tok, tokenizers: list[tuple[Any, int]]):
    """A fresh copy of `base_tok` with every token of `tokenizers` (each below its model's size) added."""
    from transformers import AutoTokenizer

    plain: dict[str, None] = {}
    added: dict[str, Any] = {}
    for tok, size in tokenizers:
        # mergekit tests a token against the id-keyed added-token map, which never matches: added tokens are
        # collected with the plain ones too, and added below with their settings.
        for t, i in tok.get_vocab().items():
            if i < size:
                plain.setdefault(t)
        for i, info in tok.added_tokens_decoder.items():
            if i < size:
                added.setdefault(info.content, info)
    with tempfile.TemporaryDirectory() as d:  # a copy: the base tokenizer itself is left as it is
        base_tok.save_pretrained(d, legacy_format=False, safe_serialization=True)
        out = AutoTokenizer.from_pretrained(d, use_fast=True, trust_remote_code=False)
    base_vocab = base_tok.get_vocab()
    for t in plain:
        if t not in added and t not in base_vocab:
            out.add_tokens(t)
    for info in added.values():
        out.add_tokens(info)
    return out


@dataclasses.dataclass
class Vocabulary:
    """The output tokenizer of a recipe and how each model's vocabulary rows move into it.

    Attributes:
        tokenizer: the output tokenizer (transformers).
        tokens: `{token: id}` of the output, ids `0 … V−1`.
        permutations: per model path, the model's row of each output id (`-1`: the model lacks the token).
        participants: per vocabulary tensor kind (`"pre"`, `"post"`), the model paths of the tensor, in order.
        base: the base model's path, or None.
        dtype: the recipe's arithmetic dtype name (`torch`), or None for the inputs' common dtype.
        fp32: `fp32_arithmetic`: fill in float32, round once.
    """

    tokenizer: Any
    tokens: dict[str, int]
    permutations: dict[str, list[int]]
    participants: dict[str, list[str]]
    base: str | None
    dtype: str | None
    fp32: bool
    allow_pickle: bool = False
    sources: dict[str, _Source] = dataclasses.field(default_factory=dict)
    original: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    pad_to_multiple_of: int | None = None
    _checkpoints: dict[str, ModelCheckpoint] = dataclasses.field(default_factory=dict)
    _aligned: dict[tuple[str, str], TensorInfo | None] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def padded_size(self) -> int:
        """The rows of the output's vocabulary tensors and `config.json`'s `vocab_size` (`pad_to_multiple_of`)."""
        return padded(self.size, self.pad_to_multiple_of)

    # -- the hook `plan.build_plan` calls on every checkpoint it opens ----------------------------------------

    def align(self, path: str, ckpt: ModelCheckpoint) -> ModelCheckpoint:
        """`ckpt` with its vocabulary tensors replaced by their aligned `(V, ...)` versions (in memory), or as it
        is when every model of a tensor already has the output vocabulary, row for row."""
        self._checkpoints.setdefault(path, ckpt)
        tensors = dict(ckpt.tensors)
        changed = False
        for name in [n for n in tensors if n in VOCAB_TENSORS] + self._tied_outputs(path, ckpt):
            info = self._tensor(path, name)
            if info is not None:
                tensors[name] = info
                changed = True
        return dataclasses.replace(ckpt, tensors=tensors) if changed else ckpt

    def _tied_outputs(self, path: str, ckpt: ModelCheckpoint) -> list[str]:
        """The output embeddings `ckpt` lacks (saved tied) that another model of the tensor stores: mergekit reads
        the model's input embedding in their place (its architectures' `tied_names`), and so does `_align`."""
        post = self.participants["post"]
        if path not in post:
            return []
        others = [self._checkpoint(p) for p in post if p != path]
        return [n for n in TIED_OUTPUT_NAMES if n not in ckpt.tensors and any(n in c.tensors for c in others)]

    def _checkpoint(self, path: str) -> ModelCheckpoint:
        if path not in self._checkpoints:
            from .plan import open_checkpoint

            self._checkpoints[path] = open_checkpoint(path, path, self.allow_pickle)
        return self._checkpoints[path]

    def _tensor(self, path: str, name: str) -> TensorInfo | None:
        if (path, name) not in self._aligned:
            paths = self.participants["pre" if is_pre_layer(name) else "post"]
            if path not in paths:  # a model this tensor is not merged from: left as it is
                return None
            self._aligned.update({(p, name): info for p, info in self._align(paths, name).items()})
        return self._aligned[(path, name)]

    def _align(self, paths: list[str], name: str) -> dict[str, TensorInfo | None]:
        import torch

        from .io.reader import SafetensorsReader

        ckpts = {p: self._checkpoint(p) for p in paths}
        stored = {p: name if name in ckpts[p].tensors else tied_input(name, ckpts[p]) for p in paths}
        lacking = [p for p, n in stored.items() if n is None]
        if lacking:
            raise ValueError(f"tokenizer_source: tensor {name!r} is missing from {lacking}, which have no input "
                             "embedding to stand for it, but present in other models of the recipe")  # fmt: skip
        V = self.size
        infos = {p: ckpts[p].tensors[stored[p]] for p in paths}
        forced = any(self.sources[t].force for t in self.sources if t in self.tokens)
        if not forced and self.padded_size == V and all(
            self.permutations[p] == list(range(V)) and infos[p].n_rows == V and stored[p] == name for p in paths
        ):
            return dict.fromkeys(paths)
        xs = {}
        for p in paths:
            with SafetensorsReader(ckpts[p]) as r:
                xs[p] = r.read_tensor(stored[p])
        store = xs[paths[0]].dtype
        for x in xs.values():
            store = torch.promote_types(store, x.dtype)
        if self.dtype is not None and not self.fp32:
            store = getattr(torch, self.dtype)
        work = torch.float32 if self.fp32 else store
        xs = {p: x.to(work) for p, x in xs.items()}
        order = sorted(self.tokens, key=self.tokens.get)
        filled = fill_rows(xs, {p: self.permutations[p] for p in paths}, self.base, tokens=order,
                           sources=self.sources, original=self.original, pad_to=self.padded_size)  # fmt: skip
        names = {v: k for k, v in torch_dtypes().items()}
        out = {}
        for p, x in filled.items():
            x = x.to(store).contiguous()
            raw = x.reshape(-1).view(torch.uint8)
            out[p] = TensorInfo(name, names[store], tuple(x.shape), f"{p}#union-vocabulary", 0, raw.numel(), raw)
        return out

    # -- output files ----------------------------------------------------------------------------------------

    def same_as(self, folder: str | Path) -> bool:
        """True when `folder`'s tokenizer has the output's tokens and added tokens (its files can be copied)."""
        try:
            tok = _load_tokenizer(str(folder))
        except (OSError, ValueError):
            return False
        return tok.get_vocab() == self.tokens and _added(tok) == _added(self.tokenizer)

    def save(self, out: Path) -> list[str]:
        """Write the output tokenizer into `out`; returns the names written."""
        before = set(p.name for p in out.iterdir())
        self.tokenizer.save_pretrained(str(out))
        return sorted(set(p.name for p in out.iterdir()) - before)


def _added(tok) -> dict[int, tuple[str, bool]]:
    return {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()}


def fill_rows(xs: dict, permutations: dict[str, list[int]], base: str | None, *, tokens: list[str] | None = None,
              sources: dict | None = None, original: dict | None = None, pad_to: int | None = None) -> dict:
    """Each model's vocabulary tensor moved into the output vocabulary (mergekit 0.1.5 `PermutedVocabulary`).

    Args:
        xs: per model (in the tensor's model order), its `(R, ...)` tensor, in the arithmetic dtype.
        permutations: per model, a list of length `V`: the model's row for each output id, `-1` where it lacks it.
        base: the base model (a key of `xs`), or None.
        tokens: the output's token of each id (length `V`); needed with `sources`.
        sources: `{token: tokens.TokenEmbedding}` with model paths in place of models (`tokenizer.tokens`).
        original: per model path, its tokenizer's `{token: id}` (a `model_token` source given by token).
        pad_to: the output's row count `P ≥ V` (`pad_to_multiple_of`), or None for `V`.

    Returns:
        per model, a `(P, ...)` tensor: its own row where it has the token and the token is not forced; else the
        token's configured source (`sources`), the row of its only holder, the base's row (base among the models and
        holding it), the mean of the holders' rows (summed in model order, then divided by their count), or zeros
        (no holder); rows `V … P−1` are the mean of that model's rows `0 … V−1`.

    Raises:
        ValueError: where mergekit fails: a configured token some model lacks (or forced) with no source, or a source
            model that is not among the tensor's models, lacks the token, or has no such row.
    """
    import torch

    models = list(xs)
    first = xs[models[0]]
    V = len(permutations[models[0]])
    sources = sources or {}
    idx = {m: torch.tensor(permutations[m], dtype=torch.long) for m in models}
    have = torch.stack([idx[m] >= 0 for m in models])  # (M, V)
    forced = {j for j, t in enumerate(tokens or ()) if t in sources and sources[t].force}
    defaults: dict[int, torch.Tensor] = {}
    for j in sorted(set(torch.nonzero(~have.all(0)).flatten().tolist()) | forced):
        cfg = sources.get(tokens[j]) if tokens is not None else None
        holders = [m for m, h in zip(models, have[:, j].tolist(), strict=True) if h]
        if cfg is not None:
            defaults[j] = _source_row(cfg, tokens[j], j, xs, permutations, original or {})
        elif len(holders) == 1:
            defaults[j] = xs[holders[0]][permutations[holders[0]][j]]
        elif not holders:
            defaults[j] = first.new_zeros(first.shape[1:])
        elif base in xs and permutations[base][j] >= 0:
            defaults[j] = xs[base][permutations[base][j]]
        else:
            acc = first.new_zeros(first.shape[1:])
            for m in holders:
                acc = acc + xs[m][permutations[m][j]]
            defaults[j] = acc / len(holders)
    P = max(V, pad_to or V)
    out = {}
    for m in models:
        x = first.new_zeros((P, *first.shape[1:]))
        own = (idx[m] >= 0).clone()
        own[sorted(forced)] = False
        x[:V][own] = xs[m][idx[m][own]]
        for j, row in defaults.items():
            if not bool(own[j]):
                x[j] = row
        if P > V:  # mergekit: the mean of the model's rows, after the ones above are filled
            x[V:] = torch.mean(x[:V], dim=0)
        out[m] = x
    return out


def _source_row(cfg, token: str, j: int, xs: dict, permutations: dict, original: dict):
    """The row `tokenizer.tokens[token]` names (mergekit `PermutedVocabulary.compute_default_embedding`)."""
    first = next(iter(xs.values()))
    if cfg.kind == "zero":
        return first.new_zeros(first.shape[1:])
    if cfg.kind is None:
        raise ValueError(f"tokenizer.tokens[{token!r}] has no source, but the token is forced or missing from some "
                         "model (mergekit 0.1.5 fails on it too: NotImplementedError)")  # fmt: skip
    where = f"tokenizer.tokens[{token!r}].source"
    path = cfg.model  # a model path (`build_vocabulary` resolves the recipe's names), or None: not in the recipe
    if path not in xs:
        raise ValueError(f"{where}: model {cfg.label!r} is not one of this tensor's models (mergekit 0.1.5 fails on "
                         "it too: the vocabulary weight is missing)")  # fmt: skip
    if cfg.kind == "model":
        if permutations[path][j] < 0:
            raise ValueError(f"{where}: model {cfg.label!r} lacks the token (mergekit 0.1.5 fails on it too)")
        return xs[path][permutations[path][j]]
    src = cfg.token_id
    if src is None:
        if cfg.token not in original.get(path, {}):
            raise ValueError(f"{where}: token {cfg.token!r} is not in the tokenizer of model {cfg.label!r} "
                             "(mergekit 0.1.5 fails on it too)")  # fmt: skip
        src = original[path][cfg.token]
    if not 0 <= src < xs[path].shape[0]:
        raise ValueError(f"{where}: token id {src} is out of range for model {cfg.label!r} ({xs[path].shape[0]} rows; "
                         "mergekit 0.1.5 fails on it too)")  # fmt: skip
    return xs[path][src]


@dataclasses.dataclass(frozen=True)
class _Source:
    """A `tokens.TokenEmbedding` with its model resolved to the path the tensors are keyed by."""

    kind: str | None
    model: str | None
    label: str | None
    token: str | None
    token_id: int | None
    force: bool


def build_vocabulary(config) -> Vocabulary | None:
    """The recipe's output vocabulary when it names a `tokenizer_source` (None without one), reading tokenizers and
    configs only: the union (`union`), the stripped base tokenizer (`base`), or a model's tokenizer. `ValueError`
    where mergekit 0.1.5 fails (see the module docstring); for `base` or a model, a tokenizer that cannot be loaded
    or stripped gives None (the tokenizer files are copied and the vocabularies must already agree), unless the
    recipe has `tokenizer.tokens` or `pad_to_multiple_of`, which need it (`ValueError`)."""
    source = config.tokenizer_source
    if source is None:
        return None
    where = f"tokenizer_source: {source}"
    refs = [config.base_model] if config.base_model is not None else []
    refs += list(config.models)
    paths, labels = [], {}
    for ref in refs:
        path = resolve_model_path(ref.model, ref.revision)
        if path not in labels:
            paths.append(path)
            labels[path] = ref.spec
    base_path = paths[0]  # the base, else the first model (mergekit: the first of its set of models)
    sizes = {p: config_vocab_size(p) for p in paths}
    try:
        base_tok = _load_tokenizer(base_path)
        tokenizers = {base_path: _stripped(base_tok, sizes[base_path] or len(base_tok.get_vocab()), labels[base_path])}
        if source not in ("union", "base"):
            out = _load_tokenizer(_source_path(config, source))
    except (OSError, ValueError) as err:
        if source != "union" and not (config.tokenizer_tokens or config.pad_to_multiple_of):
            return None  # the files are copied; `tokens` and padding need the tokenizer
        raise ValueError(f"{where}: the tokenizer of {labels[base_path]!r} cannot be loaded or stripped ({err}); "
                         "mergekit 0.1.5 fails on it too") from None  # fmt: skip
    for p in paths[1:]:
        try:
            tokenizers[p] = _load_tokenizer(p)
        except (OSError, ValueError):  # mergekit: "assuming same as" the base
            continue
    if source == "union":
        out = _union(tokenizers[base_path], [(t, sizes[p] or t.vocab_size) for p, t in tokenizers.items()])
    elif source == "base":
        out = tokenizers[base_path]  # the base's own tokenizer: tokens added below are the base's too, as in mergekit
    configured = config.tokenizer_tokens or {}
    for t in configured:  # mergekit's `add_tokens`: the configured tokens the output lacks
        if t not in out.get_vocab():
            out.add_tokens(t)
    tokens = out.get_vocab()
    if sorted(tokens.values()) != list(range(len(tokens))):
        raise ValueError(f"{where}: the output tokenizer's ids are not 0 … V−1")
    permutations = {}
    for p in paths:
        vocab = (tokenizers[p] if p in tokenizers else tokenizers[base_path]).get_vocab()
        size = sizes[p] if sizes[p] is not None else len(vocab)
        perm = [-1] * len(tokens)
        for t, j in tokens.items():
            i = vocab.get(t)
            if i is not None and i >= size:
                raise ValueError(
                    f"{where}: token {t!r} of the output vocabulary is at id {i} in model {labels[p]!r}, past its "
                    f"vocab_size {size} (mergekit 0.1.5 fails on it too)"
                )
            perm[j] = -1 if i is None else i
        permutations[p] = perm
    sources = {t: _resolve_source(config, e) for t, e in configured.items()}
    return Vocabulary(out, tokens, permutations, _participants(config), paths[0] if config.base_model else None,
                      _dtype_name(config), bool(config.fp32_arithmetic), bool(config.allow_pickle), sources,
                      {p: t.get_vocab() for p, t in tokenizers.items()}, config.pad_to_multiple_of)  # fmt: skip


def _resolve_source(config, entry) -> _Source:
    """A `tokenizer.tokens` entry with its model as the path of the recipe's model it names (None: not one)."""
    path = None
    if entry.model is not None:
        refs = ([config.base_model] if config.base_model is not None else []) + list(config.models)
        for ref in refs:
            if ref.same_model(entry.model) or entry.model.spec == ref.spec:
                path = resolve_model_path(ref.model, ref.revision)
                break
    label = entry.model.spec if entry.model is not None else None
    return _Source(entry.kind, path, label, entry.token, entry.token_id, entry.force)


def _source_path(config, source: str) -> str:
    """The folder of `tokenizer_source: <model>`: a model of the recipe (by its name), else a path or Hub id."""
    refs = ([config.base_model] if config.base_model is not None else []) + list(config.models)
    for ref in refs:
        if source in (ref.spec, ref.model):
            return resolve_model_path(ref.model, ref.revision)
    return resolve_model_path(source)


def _participants(config) -> dict[str, list[str]]:
    """Per vocabulary tensor kind, its models in mergekit's order: the recipe's models then the base (`models:`),
    or the first (`pre`) / last (`post`) slice's sources."""

    def paths(refs) -> list[str]:
        return list(dict.fromkeys(resolve_model_path(r.model, r.revision) for r in refs))

    if config.slices is None:
        refs = list(config.models)
        if config.base_model is not None:
            refs.append(config.base_model)
        return {"pre": paths(refs), "post": paths(refs)}
    return {"pre": paths([s.model for s in config.slices[0].sources]),
            "post": paths([s.model for s in config.slices[-1].sources])}  # fmt: skip


def _dtype_name(config) -> str | None:
    from .config import DTYPE_NAMES
    from .io.dtypes import TORCH_NAMES

    return TORCH_NAMES[DTYPE_NAMES[config.dtype]] if config.dtype else None


__all__ = ["VOCAB_TENSORS", "Vocabulary", "build_vocabulary", "config_vocab_size", "fill_rows"]

"""The model card (`README.md`) of a merged model.

Metadata follows mergekit's `mergekit/card.py` conventions (a `base_model` list of the parents, the recipe embedded as
YAML, `library_name: transformers`) and the Hub's model tree (`base_model_relation: merge`, hub-docs
`docs/hub/model-cards.md`), written with `huggingface_hub.ModelCardData` so the front matter round-trips through
`ModelCard`. The body adds what a merge user needs to judge the result: the method and its paper, the inputs and
their weights, the collapse diagnostics summary (docs/merging.md, "Diagnostics") and how to load and reproduce the
merge. One builder serves the CLI, the `merge()` API and the training callbacks.

No local path (user names, mount points) reaches the Hub: `base_model` lists only the parents that are Hub ids (as
mergekit does, without `@revision`), and the body and the embedded recipe name local checkpoints by their folder
name. No token ever enters the card: only the recipe and the diagnostics are rendered, and any string that looks
like a Hub token is masked as a last line of defence.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from .._files import write_text_atomic
from .resolve import is_hub_id, split_revision


CARD_FILE = "README.md"
RECIPE_FILE = "hf_stable_merge.yaml"

DIAGNOSTICS_TEXT = (
    "Collapse diagnostics (hf_stable's `docs/merging.md`, \"Diagnostics\"). The norm ratio "
    "ρ = ‖merged‖ / Σ α_i ‖input_i‖ is computed per tensor; values well below 1 mean the merge shrank the weights "
    "(ρ = 1/√N for N mutually orthogonal inputs averaged). The activation-variance and effective-rank ratios compare "
    "the merged model's hidden states with its inputs' on a probe set; KL is KL(expert ‖ merged) of next-token "
    "distributions, in nats."
)


def _render(data: ModelCardData, *, model_name, n_inputs, method, method_text, inputs, base, recipe, diagnostics,
            model_id, versions, citations) -> str:  # fmt: skip
    """The card as markdown with YAML front matter (plain formatting: no template engine to load per merge)."""
    out = ["---", data.to_yaml(), "---", "", f"# {model_name}", ""]
    out += [
        f"This model is a merge of {n_inputs} pre-trained language model{'s' if n_inputs != 1 else ''} made with "
        f"**{method}** by [hf_stable](https://github.com/hf-stable/hf_stable)'s streaming merge engine "
        "(`hf-stable merge`).",
        "",
        "## Method",
        "",
        method_text,
        "",
        "## Inputs",
        "",
        "| model | weight |",
        "|---|---|",
        *(f"| `{name}` | {weight} |" for name, weight in inputs),
    ]
    if base:
        out += ["", f"Base model: `{base}`."]
    out += ["", "## Recipe", "", f"The recipe (also saved as `{RECIPE_FILE}`):", "", "```yaml", recipe, "```"]
    if diagnostics:
        out += ["", "## Diagnostics", "", DIAGNOSTICS_TEXT, "", "| statistic | value |", "|---|---|"]
        out += [f"| {key} | {value} |" for key, value in diagnostics]
    out += [
        "",
        "## How to use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{model_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")',
        "```",
        "",
        f"To reproduce the merge: `hf-stable merge {RECIPE_FILE} ./merged`.",
        "",
        "## Framework versions",
        "",
        *(f"- {name}: {v}" for name, v in versions),
    ]
    if citations:
        out += ["", "## Citations"]
        for citation in citations:
            out += ["", "```bibtex", citation, "```"]
    return "\n".join(out) + "\n"


# Labels of the diagnostics summary keys (`hf_stable.merging.diagnostics.summary`), in display order.
DIAGNOSTIC_LABELS = {
    "n_tensors": "tensors analysed",
    "norm_ratio_min": "norm ratio ρ, min",
    "norm_ratio_min_tensor": "tensor with the min ρ",
    "norm_ratio_median": "norm ratio ρ, median",
    "norm_ratio_max": "norm ratio ρ, max",
    "pairwise_angle_median_deg": "pairwise input angle, median (°)",
    "pairwise_angle_max_deg": "pairwise input angle, max (°)",
    "pairwise_angle_histogram": "pairwise input angles, histogram (° bin: count)",
    "angle_to_merge_max_deg": "angle input → merge, max (°)",
    "n_tokens": "probe tokens",
    "var_ratio_min": "activation-variance ratio ρ^var, min",
    "var_ratio_min_layer": "layer with the min ρ^var",
    "erank_ratio_min": "effective-rank ratio, min",
    "erank_ratio_min_layer": "layer with the min erank ratio",
    "kl_mean": "KL(expert ‖ merged), mean over experts",
    "kl_max": "KL(expert ‖ merged), max over experts",
    "entropy_merged": "predictive entropy of the merge (nats)",
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# User access tokens (`hf_` + 34 alphanumerics today); masked wherever they appear in the rendered card.
_TOKEN = re.compile(r"hf_[A-Za-z0-9]{20,}")


def parent_name(model: str) -> str:
    """How a parent is named on the Hub: a Hub id as written (without `@revision`), a local path by its folder name.

    `org/name@rev` → `org/name`; `/home/me/ckpts/expert-a/` → `expert-a`; `./runs/a` → `a`.
    """
    model, _ = split_revision(str(model))
    if is_hub_id(model):
        return model
    return Path(model.rstrip("/\\")).name or model


@dataclass
class _Ref:
    model: str
    parameters: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        return self.model


@dataclass
class _DictRecipe:
    """A plain recipe dict (data-driven methods such as `fw_merging` keep their own schema) seen as a config."""

    data: dict

    @property
    def merge_method(self) -> str:
        return str(self.data.get("merge_method", "unknown"))

    @property
    def models(self) -> list[_Ref]:
        entries = self.data.get("models") or self.data.get("pool") or []
        refs = [e if isinstance(e, dict) else {"model": e} for e in entries]
        return [_Ref(str(e.get("model")), dict(e.get("parameters") or {})) for e in refs]

    @property
    def base_model(self) -> _Ref | None:
        base = self.data.get("base_model")
        return None if base is None else _Ref(str(base.get("model") if isinstance(base, dict) else base))

    @property
    def parameters(self) -> dict:
        return dict(self.data.get("parameters") or {})

    def to_yaml(self, *, redact: bool = False) -> str:
        import yaml

        from .config import _redact_paths

        data = _redact_paths(self.data) if redact else self.data
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _ref_string(ref: Any) -> str:
    return str(getattr(ref, "model", ref))


def _displayed(ref: Any) -> str:
    """A model as listed in the body: Hub ids with their revision; local checkpoints by folder name only."""
    spec = str(getattr(ref, "spec", ref))
    return spec if is_hub_id(_ref_string(ref)) else parent_name(_ref_string(ref))


def parents(config: Any) -> list[str]:
    """The `base_model` list: the Hub ids among the base model (first) and the inputs, each once."""
    refs = ([config.base_model] if getattr(config, "base_model", None) is not None else []) + list(config.models)
    return list(dict.fromkeys(parent_name(_ref_string(r)) for r in refs if is_hub_id(_ref_string(r))))


def method_info(name: str) -> tuple[str, list[str]]:
    """`(markdown paragraph, bibtex entries)` for a merge method, from its registration (description and paper)."""
    from hf_stable.merging.methods import MERGE_METHODS

    description = paper = url = ""
    citations: list[str] = []
    if name in MERGE_METHODS:
        entry = MERGE_METHODS.get(name)
        description, paper, url = entry.description, entry.paper_text, entry.url
        if getattr(entry.paper, "bibtex", None):
            citations.append(entry.paper.bibtex)
    text = f"`merge_method: {name}`."
    if description:
        text += f" {description.rstrip('.')}."
    if paper:
        text += f" Paper: [{paper}]({url})." if url else f" Paper: {paper}."
    return text, citations


def _weight(config: Any, index: int) -> str:
    """The weight of input ``index`` as the recipe gives it (its own, else the global one)."""
    raw = (getattr(config.models[index], "parameters", None) or {}).get("weight")
    if raw is None:
        raw = (getattr(config, "parameters", None) or {}).get("weight")
    if raw is None:
        return "default"
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return f"{raw:g}"
    return "per tensor (see the recipe)"


def _format(value: Any) -> str:
    if isinstance(value, Mapping):
        return " · ".join(f"{k}: {v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def _diagnostic_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`(label, value)` rows: known keys in `DIAGNOSTIC_LABELS` order, then any others; None values left out."""
    order = list(DIAGNOSTIC_LABELS)
    keys = sorted(summary, key=lambda k: order.index(k) if k in order else len(order))
    return [(DIAGNOSTIC_LABELS.get(k, k), _format(summary[k])) for k in keys if summary[k] is not None]


def mask_tokens(text: str, secrets: tuple[str | None, ...] = ()) -> str:
    """``text`` with Hub-token-looking strings and the given ``secrets`` replaced by `***`."""
    text = _TOKEN.sub("hf_***", text)
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "***")
    return text


def merge_model_card(
    config: Any,
    result: Any = None,
    diagnostics_summary: Mapping[str, Any] | None = None,
    *,
    model_name: str | None = None,
    hub_model_id: str | None = None,
    base_models: list[str] | None = None,
    license: str | None = None,
) -> str:
    """Render the README.md of a merged model.

    Args:
        config: the [`~hf_stable.merging.config.MergeConfig`] that produced the merge, or a recipe dict (data-driven
            methods: `models` or `pool` entries, `base_model`, `parameters`).
        result: the `MergeResult` (or a dict with `output_dir`; it names the model when ``model_name`` is not
            given), or None.
        diagnostics_summary: flat summary from `hf_stable.merging.diagnostics.summary`, or None.
        model_name: the card's title (default: ``hub_model_id``'s name, else the output folder's name).
        hub_model_id: the repository the card will live in (used in the loading snippet).
        base_models: override of the `base_model` list (e.g. Hub ids of parents merged from local copies).
        license: optional `license` metadata.

    Returns:
        The card text: YAML front matter (`base_model` list, `base_model_relation: merge`, `library_name:
        transformers`, `tags: [hf_stable, merge, <method>]`) and the markdown body.
    """
    from hf_stable.cards import _versions

    if isinstance(config, Mapping):
        config = _DictRecipe(dict(config))
    method = config.merge_method
    output_dir = result.get("output_dir") if isinstance(result, Mapping) else getattr(result, "output_dir", None)
    if model_name is None:
        if hub_model_id:
            model_name = hub_model_id.split("/")[-1]
        elif output_dir:
            model_name = Path(os.fspath(output_dir)).resolve().name
        else:
            model_name = f"{method}-merge"
    data = ModelCardData(
        base_model=(list(base_models) if base_models is not None else parents(config)) or None,
        base_model_relation="merge",
        library_name="transformers",
        tags=list(dict.fromkeys(["hf_stable", "merge", method])),
        license=license,
        model_name=model_name,
    )
    method_text, citations = method_info(method)
    if getattr(config, "fp32_arithmetic", False):
        method_text += (
            "\n\nArithmetic: float32 (`fp32_arithmetic: true`), not the recipe's `dtype`: more precise than "
            "mergekit, so the weights are not mergekit's output for the same recipe."
        )
    diagnostics = _diagnostic_rows(diagnostics_summary or {})
    base = getattr(config, "base_model", None)
    card = _render(
        data,
        model_name=model_name,
        n_inputs=len(config.models),
        method=method,
        method_text=method_text,
        inputs=[(_displayed(ref), _weight(config, i)) for i, ref in enumerate(config.models)],
        base=_displayed(base) if base is not None else None,
        recipe=config.to_yaml(redact=True).strip(),
        diagnostics=diagnostics,
        model_id=hub_model_id or model_name,
        versions=_versions(),
        citations=citations,
    )
    secrets = (os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    return mask_tokens(str(card), secrets)


def write_merge_card(folder: str | os.PathLike, card_text: str) -> str:
    """Write ``card_text`` to ``folder/README.md`` atomically (temporary file, then rename); returns the path."""
    return write_text_atomic(os.path.join(os.fspath(folder), CARD_FILE), card_text)

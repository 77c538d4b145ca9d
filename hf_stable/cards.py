"""Model cards for checkpoints hf_stable trains (merged models have their own, in `hf_stable.merging.card`).

The metadata follows TRL's `generate_model_card` (`trl/trainer/utils.py`): `base_model` only when it is a Hub id,
`library_name: transformers`, `generated_from_trainer` plus the trainer's tags. The body says which hf_stable method
produced the weights, with its settings and paper, so a card on the Hub is enough to reproduce the run. Only the
settings passed in are written — never the training arguments wholesale, so no token can leak into a card.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version


TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{% if base_model %}This model is a fine-tuned version of [{{ base_model }}](https://huggingface.co/{{ base_model }})\
{% else %}This model was fine-tuned from a local checkpoint{% endif %}\
{% if dataset_name %} on the `{{ dataset_name }}` dataset{% endif %}. It was trained with **{{ trainer_name }}** from \
[hf_stable](https://github.com/hf-stable/hf_stable), a subclass of `{{ trl_trainer }}`.

## Method

{{ method }}

## Settings

```yaml
{{ settings }}
```

## Quick start

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{{ model_id }}")
print(generator("{{ example_prompt }}", max_new_tokens=32)[0]["generated_text"])
```

## Framework versions

{% for name, v in versions %}- {{ name }}: {{ v }}
{% endfor %}
## Citations
{% for citation in citations %}
```bibtex
{{ citation }}
```
{% endfor %}
"""

TRL_CITATION = """@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and
             Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallou{\\'e}dec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}"""


@dataclass
class TrainingCard:
    """What a card says about a training run."""

    trainer_name: str
    trl_trainer: str
    method: str
    settings: dict
    tags: list[str]
    citations: list[str] = field(default_factory=list)
    example_prompt: str = "Hello"


@dataclass
class CardSections:
    """Parts of a card's body: method lines, settings, papers and tags. Trainers build them from the active declared
    methods ([`method_sections`]) plus their own `_card_sections()`, then [`write_training_card`] renders them."""

    lines: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    papers: list = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    def extend(self, other: CardSections) -> CardSections:
        self.lines += other.lines
        self.settings.update(other.settings)
        self.papers += [p for p in other.papers if p not in self.papers]
        self.tags += other.tags
        return self

    def method_text(self) -> str:
        papers = "\n".join(f"Paper: [{p.title}]({p.url})." for p in self.papers)
        return "\n".join(self.lines) + (f"\n\n{papers}" if papers else "")


def method_sections(args, registries) -> CardSections:
    """The active declared methods of ``registries`` on config ``args``: one line each (selector value, description,
    paper), their settings (``Method.settings_from``), papers and tags. A selector left at ``None`` (off) and a
    switch left off are not listed; a host built-in (e.g. `advantage_estimator="grpo"`) is listed by value."""
    from .papers import Paper

    out = CardSections()
    for registry in registries:
        value = getattr(args, registry.selector)
        method = registry.active(args)
        if value is None or (registry.is_switch and method is None):
            continue
        out.settings[registry.selector] = value
        line = f"- {registry.selector}: `{value}`"
        if method is not None:
            line += f" — {method.description}" if method.description else ""
            out.settings.update(method.settings_from(args))
            if isinstance(method.paper, Paper):
                line += f" ({method.paper.short})"
                out.papers += [method.paper] if method.paper not in out.papers else []
                out.tags.append(method.name)
        out.lines.append(line)
    return out


def _versions() -> list[tuple[str, str]]:
    out = []
    for package in ("hf-stable", "trl", "transformers", "torch", "datasets", "tokenizers", "peft"):
        try:
            out.append((package, version(package)))
        except PackageNotFoundError:
            continue
    return out


def _yaml(settings: dict) -> str:
    import yaml

    return yaml.safe_dump(settings, sort_keys=False, allow_unicode=True).strip()


def write_training_card(
    card: TrainingCard,
    output_dir: str,
    *,
    model_name: str | None = None,
    base_model: str | None = None,
    hub_model_id: str | None = None,
    dataset_name: str | None = None,
) -> str:
    """Render ``card`` to ``output_dir/README.md`` (atomically) and return the path."""
    from huggingface_hub import ModelCard, ModelCardData

    if not base_model or os.path.isdir(base_model):  # a local path (or none) is not a Hub lineage
        base_model = None
    if dataset_name and os.path.exists(dataset_name):  # nor is a local dataset folder; no local path goes to the Hub
        dataset_name = None
    tags = ["generated_from_trainer", *dict.fromkeys(card.tags)]
    data = ModelCardData(
        base_model=base_model, datasets=dataset_name, library_name="transformers", tags=tags, model_name=model_name
    )
    rendered = ModelCard.from_template(
        data,
        template_str=TEMPLATE,
        model_name=model_name or os.path.basename(os.path.abspath(output_dir)),
        base_model=base_model,
        dataset_name=dataset_name,
        trainer_name=card.trainer_name,
        trl_trainer=card.trl_trainer,
        method=card.method,
        settings=_yaml(card.settings),
        model_id=hub_model_id or output_dir,
        example_prompt=card.example_prompt,
        versions=_versions(),
        citations=[*card.citations, TRL_CITATION],
    )
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "README.md")
    tmp = path + ".tmp"
    rendered.save(tmp)
    os.replace(tmp, path)
    return path

"""The unlearning model card: what was unlearned (method, settings, set sizes, metrics), never the forget rows."""

from __future__ import annotations

import os

from ...adapters.card import adapter_card_info
from ...cards import TrainingCard, write_training_card
from ...losses.unlearning import FORGET_LOSSES


def card_sections(trainer, metrics: dict | None = None) -> tuple[list[str], dict, list, list[str]]:
    """``(lines, settings, papers, tags)`` of ``trainer``'s run, from the active declarations."""
    args = trainer.args
    method, loss = args.method, FORGET_LOSSES.get(args.forget_loss_name)
    papers = [p for p in (method.paper, loss.paper) if hasattr(p, "bibtex")]
    papers = [p for i, p in enumerate(papers) if p not in papers[:i]]
    settings = {
        "unlearn_method": args.unlearn_method,
        "forget_rows": len(trainer._forget_rows),
        "retain_rows": len(trainer._retain_rows),
        "forget_weight": args.forget_weight,
        "retain_weight": args.retain_weight,
        "retain_loss_type": args.retain_loss_type,
        "learning_rate": args.learning_rate,
        "max_steps": args.max_steps,
        "steps_done": trainer.state.global_step,
        **method.settings_from(args),
        **loss.settings_from(args),
    }
    if args.bounded_lora:
        settings.update({k: v for k, v in vars(args).items() if k.startswith("bounded_")})
    if args.scheme == "dual":
        settings["final_lambda"] = round(trainer.dual_variable, 6)
    if metrics:
        settings["metrics"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}
    lines = [
        f"Unlearning method: `{args.unlearn_method}` ({method.paper_text}).",
        f"Forget set: {len(trainer._forget_rows)} rows (not included here); retain set: "
        f"{len(trainer._retain_rows)} rows.",
    ]
    adapter_papers, adapter_lines, adapter_settings, adapter_tags = adapter_card_info(trainer.model)
    papers += [p for p in adapter_papers if p not in papers]
    lines += adapter_lines
    settings.update(adapter_settings)
    lines += [f"Paper: [{p.title}]({p.url})." for p in papers]
    return lines, settings, papers, [f"unlearn-{args.unlearn_method}", *adapter_tags]


def write_unlearning_card(trainer, model_name=None, dataset_name=None, tags=None, metrics: dict | None = None):
    """Write ``README.md`` into ``trainer.args.output_dir`` (main process only)."""
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    lines, settings, papers, method_tags = card_sections(trainer, metrics)
    card = TrainingCard(
        trainer_name="UnlearningTrainer",
        trl_trainer="transformers.Trainer",
        method="\n\n".join(lines),
        settings=settings,
        tags=[*trainer._tag_names, *method_tags, *(tags or [])],
        citations=[p.bibtex for p in papers],
    )
    base = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "_name_or_path", None)
    if dataset_name and os.path.exists(dataset_name):  # a local folder is no Hub id, and no local path is pushed
        dataset_name = None
    write_training_card(
        card,
        args.output_dir,
        model_name=model_name or os.path.basename(os.path.abspath(args.output_dir)),
        base_model=base,
        hub_model_id=trainer.hub_model_id if args.push_to_hub else None,
        dataset_name=dataset_name,
    )

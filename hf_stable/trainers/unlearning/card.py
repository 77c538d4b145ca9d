"""What the unlearning model card adds to the shared one: set sizes, the forget loss, the dual variable and the
evaluation metrics, never the forget rows (the card itself is built by `StableTrainerMixin.create_model_card`)."""

from __future__ import annotations

from ...cards import CardSections
from ...losses.unlearning import FORGET_LOSSES


def unlearning_card_sections(trainer, metrics: dict | None = None) -> CardSections:
    """The unlearning-specific parts of ``trainer``'s card; the unlearning method itself comes from its declaration."""
    args = trainer.args
    loss = FORGET_LOSSES.get(args.forget_loss_name)
    forget, retain = len(trainer._forget_rows), len(trainer._retain_rows)
    settings = {"forget_rows": forget, "retain_rows": retain, "steps_done": trainer.state.global_step}
    settings.update(loss.settings_from(args))
    if args.bounded_lora:
        settings.update({k: v for k, v in vars(args).items() if k.startswith("bounded_")})
    if args.scheme == "dual":
        settings["final_lambda"] = round(trainer.dual_variable, 6)
    if metrics:
        settings["metrics"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}
    lines = [f"- forget set: {forget} rows (not included here); retain set: {retain} rows."]
    if loss.name != args.unlearn_method:
        lines.append(f"- forget loss: `{loss.name}` ({loss.paper_text})")
    papers = [loss.paper] if hasattr(loss.paper, "bibtex") else []
    return CardSections(lines, settings, papers, [f"unlearn-{args.unlearn_method}"])

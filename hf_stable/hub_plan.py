"""`--push_to_hub ID --hub_dry_run`: the exact commit a push would make, printed without touching the network.

One implementation for the four commands that push (`hf-stable sft|grpo|unlearn|merge`). The file lists are the ones
the real pushes send:

- `hf-stable merge` pushes with `hf_stable.merging.hub.push_merged`, whose files are `upload_files(folder)`;
- the training commands push with `Trainer.push_to_hub`, which saves the model, rewrites the card and calls
  `upload_folder(..., ignore_patterns=["_*", "checkpoint-*"])`; `upload_folder` adds huggingface_hub's
  `DEFAULT_IGNORE_PATTERNS` and filters with `filter_repo_objects` (`huggingface_hub/hf_api.py:
  _prepare_upload_folder_additions`), which [`trainer_push_files`] calls the same way.

The token scan is `hf_stable.merging.hub.check_no_token`, with the token the push would use (the one given, else the
saved one from `HF_TOKEN` / `hf auth login`); the token itself is never printed. The training commands run the same
scan before a real push, so a dry run that passes predicts a push that is not refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


# `Trainer.push_to_hub`'s own ignore list (transformers/trainer.py): private files and intermediate checkpoints.
TRAINER_IGNORE_PATTERNS = ("_*", "checkpoint-*")
_BOOL_WORDS = {"true", "false", "yes", "no", "y", "n", "t", "f", "1", "0"}


@dataclass
class CommitPlan:
    """What a push would send: repository, branch, files with their sizes, card header and token-scan result."""

    repo_id: str
    folder: str
    files: list[tuple[str, int]]
    card_metadata: str | None
    token_scan: str
    token_found: bool = False
    private: bool = False
    revision: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def render(self) -> str:
        namespace = "" if "/" in self.repo_id else "  (no namespace: your account's, resolved at push time)"
        width = max((len(name) for name, _ in self.files), default=0)
        lines = [
            "Planned Hub commit (dry run: nothing was sent)",
            f"repo:        {self.repo_id}{namespace}",
            f"repo type:   model, created if missing ({'private' if self.private else 'public'})",
            f"revision:    {self.revision or 'main'}",
            f"folder:      {self.folder}",
            f"files:       {len(self.files)}, {_human(self.total_bytes)} in all",
            *(f"  {name:<{width}}  {size:>12,d} B  {_human(size):>9}" for name, size in self.files),
            "card metadata (README.md header):",
            *(f"  {line}" for line in (self.card_metadata or "(no README.md: the push has no card)").splitlines()),
            f"token scan:  {self.token_scan}",
            *self.notes,
        ]
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def card_metadata(folder: str | os.PathLike) -> str | None:
    """The YAML header of ``folder/README.md`` with its `---` fences, as the Hub will read it; None without a card."""
    path = Path(folder) / "README.md"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return "(README.md has no YAML header)"
    end = text.find("\n---", 3)
    return text[: end + 4] if end >= 0 else "(README.md: unterminated YAML header)"


def trainer_push_files(folder: str | os.PathLike) -> list[str]:
    """The files `Trainer.push_to_hub` uploads from ``folder`` (POSIX paths relative to it, sorted)."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"push: {os.fspath(folder)!r} is not a folder")
    paths = [p.relative_to(root).as_posix() for p in sorted(root.glob("**/*")) if p.is_file()]
    ignore = [*TRAINER_IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]
    return list(filter_repo_objects(paths, ignore_patterns=ignore))


def plan_commit(
    folder: str | os.PathLike,
    repo_id: str,
    files: list[str],
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
) -> CommitPlan:
    """A [`CommitPlan`] for ``files`` of ``folder``; the token scan runs here (nothing is sent anywhere)."""
    from huggingface_hub import get_token

    from .merging.hub import check_no_token

    token = token or get_token()
    found = False
    if not token:
        scan = "skipped: no Hub token is set here (a real push needs one: `hf auth login` or HF_TOKEN)"
    else:
        try:
            check_no_token(folder, files, token)
            scan = "passed: no planned text file contains the Hub token"
        except ValueError as err:
            scan, found = f"FAILED, the push would be refused: {err}", True
    sized = [(name, (Path(folder) / name).stat().st_size) for name in files]
    return CommitPlan(
        repo_id=repo_id,
        folder=os.fspath(folder),
        files=sized,
        card_metadata=card_metadata(folder),
        token_scan=scan,
        token_found=found,
        private=private,
        revision=revision,
    )


# ---- the training commands (sft, grpo, unlearn) ---------------------------------------------------------------------


@dataclass
class HubDryRunArguments:
    """The script argument of the training commands' dry run.

    Parameters:
        hub_dry_run (`bool`, defaults to `False`):
            With `push_to_hub`: train and save as usual, then print the commit the push would make (repository,
            files with sizes, card metadata, token scan) instead of pushing; nothing is sent to the Hub.
    """

    hub_dry_run: bool = field(
        default=False, metadata={"help": "With push_to_hub: print the planned Hub commit instead of pushing."}
    )


def expand_push_to_hub(argv: list[str]) -> list[str]:
    """``--push_to_hub ID`` → ``--push_to_hub true --hub_model_id ID`` (TrainingArguments' flag is a bool).

    Raises:
        ValueError: ``--hub_model_id`` names another repository.
    """
    out, repo = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg.startswith("--push_to_hub="):
            value = arg.split("=", 1)[1]
        elif arg == "--push_to_hub" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
            i += 1
        if value is None or value.lower() in _BOOL_WORDS:
            out += [arg] if value is None else ["--push_to_hub", value]
        else:
            repo = value
            out += ["--push_to_hub", "true"]
        i += 1
    if repo is None:
        return out
    if "--hub_model_id" in out:
        given = out[out.index("--hub_model_id") + 1] if out.index("--hub_model_id") + 1 < len(out) else None
        if given != repo:
            raise ValueError(f"`push_to_hub` names {repo!r} and `hub_model_id` names {given!r}: give one repository.")
        return out
    return [*out, "--hub_model_id", repo]


def hub_dry_run_repo(script_args, training_args) -> str | None:
    """The repository a `hub_dry_run` plans for (the one `Trainer.init_hf_repo` would create), or None without
    `hub_dry_run`. Sets `push_to_hub` off so that the trainer neither creates the repository nor pushes at saves.

    Raises:
        ValueError: `hub_dry_run` without `push_to_hub`.
    """
    if not getattr(script_args, "hub_dry_run", False):
        return None
    if not training_args.push_to_hub:
        raise ValueError("`hub_dry_run` needs `push_to_hub` (e.g. `--push_to_hub user/name --hub_dry_run`).")
    training_args.push_to_hub = False
    return training_args.hub_model_id or Path(training_args.output_dir).absolute().name


def plan_trainer_push(trainer, repo_id: str, **card_kwargs) -> CommitPlan | None:
    """What `trainer.push_to_hub(**card_kwargs)` would commit to ``repo_id``: the model is saved and the card
    written exactly as that push does (same `create_model_card` call, same tags, the card naming ``repo_id``), then
    the folder is listed and scanned. Returns None on processes other than the main one."""
    args = trainer.args
    trainer.save_model(args.output_dir)
    if not trainer.is_world_process_zero():
        return None
    # Trainer.push_to_hub adds the model's own tags to the card's (transformers/trainer.py)
    model_tags = getattr(trainer.model, "model_tags", None)
    if model_tags is not None:
        tags = card_kwargs.get("tags") or []
        tags = [tags] if isinstance(tags, str) else list(tags)
        card_kwargs["tags"] = tags + [t for t in model_tags if t not in tags]
    trainer.hub_model_id, args.push_to_hub = repo_id, True  # the card names the Hub id only when pushing
    try:
        trainer.create_model_card(model_name=repo_id.split("/")[-1], **card_kwargs)
    finally:
        args.push_to_hub = False
    folder = args.output_dir
    return plan_commit(
        folder,
        repo_id,
        trainer_push_files(folder),
        token=args.hub_token,
        private=bool(args.hub_private_repo),
        revision=args.hub_revision,
    )


def push_or_plan(trainer, repo_id: str | None, **card_kwargs) -> CommitPlan | None:
    """The end of a training script: with ``repo_id`` (a dry run) print the plan; else, if `push_to_hub`, scan the
    folder for the token and push. Raises `SystemExit(1)` when the scan finds the token."""
    if repo_id is not None:
        plan = plan_trainer_push(trainer, repo_id, **card_kwargs)
        if plan is not None:
            print(plan.render(), flush=True)
            if plan.token_found:
                raise SystemExit(1)
        return plan
    if not trainer.args.push_to_hub:
        return None
    if trainer.is_world_process_zero():
        from .merging.hub import check_no_token

        folder = trainer.args.output_dir
        if os.path.isdir(folder):
            from huggingface_hub import get_token

            try:
                check_no_token(folder, trainer_push_files(folder), trainer.args.hub_token or get_token())
            except ValueError as err:
                raise SystemExit(f"hf-stable: {err}") from None
    trainer.push_to_hub(**card_kwargs)
    return None

# /// script
# dependencies = ["hf-stable"]
# ///
"""`hf-stable merge`: run a merge recipe with the streaming engine, write the model card, optionally diagnose and push.

```bash
hf-stable merge examples/configs/merge_ties.yaml ./merged                       # merge + README.md card
hf-stable merge recipe.yaml ./merged --dry-run                                   # print the plan, write nothing
hf-stable merge recipe.yaml ./merged --diagnose --probe-data probe.jsonl         # + merge_diagnostics.json
hf-stable merge recipe.yaml ./merged --memory-budget 8GB --push-to-hub me/merged --private
hf-stable merge recipe.yaml ./merged --push-to-hub me/merged --hub-dry-run          # print the planned commit
```

Order of work: the recipe, the flags, the probe file and (with `--push-to-hub`) the presence of a Hub token are
checked first, so mistakes fail in seconds rather than after the merge. Then `hf_stable.merging.merge` writes the
model, `merge_diagnostics.json` (with `--diagnose`) and `README.md` into `OUT.tmp/` and renames it to `OUT`; then the
folder is pushed (main process only). A full disk, Ctrl-C (exit 130) or any other failure is reported in one line and
leaves nothing published. The token is never taken on the command line: `huggingface_hub` reads `HF_TOKEN` or the
saved login.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


DIAGNOSTICS_FILE = "merge_diagnostics.json"


class MergeCLIError(Exception):
    """A user error reported as one line (no traceback)."""


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "hf-stable merge",
        description="Merge models from a recipe (mergekit `models:` YAML superset) with hf_stable's streaming engine.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="Merge recipe YAML (merge_method, models, parameters, ...).")
    parser.add_argument("out", metavar="OUT", help="Output folder (written as OUT.tmp, then renamed).")
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="Ceiling on the engine's buffers, e.g. 2GB, 512MiB (default: the recipe's memory_budget, else 2GB).",
    )
    parser.add_argument(
        "--push-to-hub", "--push_to_hub", metavar="REPO", default=None, help="Push the result to this Hub repo."
    )
    parser.add_argument(
        "--hub-dry-run",
        "--hub_dry_run",
        action="store_true",
        help="With --push-to-hub: merge, then print the planned commit (files, sizes, card metadata, token scan) "
        "instead of pushing; nothing is sent to the Hub.",
    )
    parser.add_argument("--private", action="store_true", help="Create the Hub repository private.")
    parser.add_argument("--revision", default=None, help="Hub branch to push to (created if missing).")
    parser.add_argument(
        "--dry-run", action="store_true", help="Print the plan (tensors, tiles, bytes); write nothing."
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help=f"Collapse diagnostics (norm ratios, angles) into OUT/{DIAGNOSTICS_FILE} and the card.",
    )
    parser.add_argument(
        "--probe-data",
        metavar="FILE",
        default=None,
        help="Probe texts (.jsonl with text|prompt[+completion]|messages, or one text per line) for the data-based "
        "diagnostics: activation-variance and effective-rank ratios, KL to each input. Implies --diagnose.",
    )
    parser.add_argument("--probe-tokens", type=int, default=2048, help="Probe tokens used (default 2048).")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="Accept pytorch_model.bin inputs (loaded with weights_only)."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace the folder OUT if it exists (never a file).")
    parser.add_argument("--seed", type=int, default=None, help="Seed of random methods (DARE); overrides the recipe.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    return parser


def _read_recipe(path: str, seed: int | None):
    """A `MergeConfig`, or the plain dict of a data-driven recipe (`fw_merging`)."""
    import yaml

    from hf_stable.merging.config import MergeConfig
    from hf_stable.merging.methods import MERGE_METHODS, get_merge_method

    if not os.path.isfile(path):
        raise MergeCLIError(f"recipe {path!r} does not exist")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise MergeCLIError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise MergeCLIError(f"recipe {path} must be a YAML mapping with merge_method and models")
    if seed is not None:
        data["seed"] = seed
    method = data.get("merge_method")
    if isinstance(method, str) and method in MERGE_METHODS and get_merge_method(method).data_driven:
        return data
    config = MergeConfig.from_dict(data)
    config.validate()  # unknown method / parameters / missing base fail here, before anything is read
    return config


def _check_args(args, parser: argparse.ArgumentParser) -> None:
    if args.private and not args.push_to_hub:
        parser.error("--private needs --push-to-hub REPO")
    if args.revision and not args.push_to_hub:
        parser.error("--revision needs --push-to-hub REPO")
    if args.hub_dry_run and not args.push_to_hub:
        parser.error("--hub-dry-run needs --push-to-hub REPO")
    if args.hub_dry_run and args.dry_run:
        parser.error("--hub-dry-run lists the files of the finished merge; --dry-run writes none: use one of them")
    if args.probe_data is not None:
        if not os.path.isfile(args.probe_data):
            parser.error(f"--probe-data {args.probe_data!r} does not exist")
        from hf_stable.merging.diagnostics import read_probe_texts

        if not read_probe_texts(args.probe_data):  # format errors surface now, not after the merge
            raise MergeCLIError(f"--probe-data {args.probe_data}: no text found")
        args.diagnose = True
    if args.probe_tokens < 2:
        parser.error("--probe-tokens must be at least 2")
    if args.push_to_hub and not args.dry_run:
        repo = args.push_to_hub
        if repo.count("/") > 1 or not repo.strip("/"):
            parser.error(f"--push-to-hub {repo!r}: expected a repository id such as user/name")
        if args.hub_dry_run:  # the plan reports a missing token instead
            return
        from huggingface_hub import get_token

        if not get_token():
            raise MergeCLIError("--push-to-hub needs a Hub token: run `hf auth login` or set HF_TOKEN")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _merge_weights(result) -> list[float] | None:
    """Overall α of the inputs for the data-based diagnostics: the mean of the merged tensors' weights."""
    plan = getattr(result, "plan", None)
    rows = [t.weights for t in getattr(plan, "tensors", []) if t.action == "merge" and t.weights is not None]
    if not rows:
        return None
    return [sum(col) / len(rows) for col in zip(*rows, strict=True)]


def _input_models(result, recipe) -> list[str]:
    plan = getattr(result, "plan", None)
    if plan is not None:
        return list(plan.input_paths)
    entries = recipe.get("models") or recipe.get("pool") or []
    return [str(e["model"] if isinstance(e, dict) else e) for e in entries]


def _diagnose(args, result, recipe, out: Path) -> dict:
    from hf_stable.merging import diagnostics as diag

    report: dict = {}
    stats = getattr(result, "per_tensor_stats", None)
    if stats:
        report["weights"] = diag.weight_diagnostics(stats)
    if args.probe_data is not None:
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        if args.no_progress:
            hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(out)
        texts = diag.read_probe_texts(args.probe_data, tokenizer)
        input_ids, attention_mask = diag.probe_batch(texts, tokenizer, max_tokens=args.probe_tokens)
        with torch.inference_mode():
            report["activations"] = diag.activation_diagnostics(
                str(out),
                _input_models(result, recipe),
                input_ids,
                _merge_weights(result),
                attention_mask=attention_mask,
                device="cuda" if torch.cuda.is_available() else None,
            )
    if not report:
        print("diagnostics: this merge method reports no per-tensor statistics; give --probe-data for data-based ones")
        return {}
    diag.to_json(report, out / DIAGNOSTICS_FILE)
    diag.print_table(report)
    return diag.summary(report)


def run(args) -> int:
    from hf_stable.distributed import is_main_process
    from hf_stable.merging.engine import merge

    if not is_main_process():  # a merge is a single-process job: other ranks of a launcher do nothing
        return 0
    recipe = _read_recipe(args.recipe, args.seed)
    start = time.perf_counter()
    # Data-driven recipes (fw_merging, a plain dict) have no streaming pass to collect per-tensor statistics from:
    # only the data-based diagnostics (--probe-data) apply to them.
    data_driven = isinstance(recipe, dict)
    failures: list[str] = []

    def diagnose(folder: Path, result) -> dict | None:
        """Runs on the complete `OUT.tmp` before the card is written and the folder published."""
        if not args.diagnose:
            return None
        try:
            return _diagnose(args, result, recipe, folder)
        except Exception as err:  # the merge itself is done: keep it, write its card, report the failure
            if os.environ.get("HF_STABLE_DEBUG"):
                raise
            failures.append(f"diagnostics failed ({type(err).__name__}: {err})")
            return None

    result = merge(
        recipe,
        args.out,
        memory_budget=args.memory_budget,
        dry_run=args.dry_run,
        diagnose=args.diagnose and not data_driven,
        progress=not args.no_progress,
        allow_pickle=True if args.allow_pickle else None,
        overwrite=args.overwrite,
        hub_model_id=args.push_to_hub,
        before_publish=diagnose,
    )
    if args.dry_run:
        plan = getattr(result, "plan", None)
        print(plan.summary() if plan is not None else result)
        print("dry run: nothing was written" + (f"; would push to {args.push_to_hub}" if args.push_to_hub else ""))
        return 0
    output_dir = result["output_dir"] if isinstance(result, dict) else result.output_dir
    out = Path(output_dir)
    elapsed = time.perf_counter() - start
    written = getattr(result, "bytes_written", None)
    size = f", {_size(written)} written" if written else ""
    print(f"merged into {out} in {elapsed:.1f} s{size}")
    if failures:
        raise MergeCLIError(f"{failures[0]}; the merged model and its card are complete in {out} (not pushed)")
    if args.hub_dry_run:
        from hf_stable.hub_plan import plan_commit
        from hf_stable.merging.hub import upload_files

        plan = plan_commit(out, args.push_to_hub, upload_files(out), private=args.private, revision=args.revision)
        print(plan.render())
        return 1 if plan.token_found else 0
    if args.push_to_hub:
        from hf_stable.merging.hub import push_merged

        try:
            push_merged(out, args.push_to_hub, private=args.private, revision=args.revision)
        except Exception as err:
            raise MergeCLIError(
                f"push to {args.push_to_hub} failed ({type(err).__name__}: {err}); the merged model is complete in "
                f"{out}: retry with `hf upload {args.push_to_hub} {out}`"
            ) from err
        print(f"pushed {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Entry point of `hf-stable merge` (and of `python -m hf_stable.scripts.merge`); returns the exit status."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    try:
        _check_args(args, parser)
        return run(args)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; nothing was published ({args.out}.tmp removed)", file=sys.stderr)
        return 130
    except (MergeCLIError, ValueError, OSError) as err:  # OSError: a full disk, a missing file, OUT exists
        if os.environ.get("HF_STABLE_DEBUG"):  # the full traceback, for bug reports
            raise
        message = str(err).strip() or type(err).__name__
        if isinstance(err, OSError) and not isinstance(err, (FileNotFoundError, FileExistsError)):
            message = f"{message.splitlines()[0]} ({type(err).__name__}; nothing was published)"
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

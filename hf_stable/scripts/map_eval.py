"""`hf-stable eval`: MaP on a folder of checkpoints (Wang et al., arXiv 2510.09295; docs/evaluation.md, "MaP").

```bash
hf-stable eval runs/sft --dataset problems.jsonl --num_checkpoints 4 --num_samples 8 --ks 1,4 --output map.json
```

Averages the model weights of the last `--num_checkpoints` `checkpoint-<step>` folders (uniform mean, fp64 sums;
safetensors only, no remote code), loads the mean into the newest checkpoint's model, samples `--num_samples`
answers per row of `--dataset` (a .json list or .jsonl file of rows with `prompt` and `answer`), and prints the
unbiased pass@k as JSON (also written atomically to `--output`). Expected failures print one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hf_stable._files import write_text_atomic


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a training output_dir holding checkpoint-<step> folders")
    parser.add_argument("--dataset", required=True, help=".json (list of rows) or .jsonl with prompt and answer")
    parser.add_argument("--num_checkpoints", type=int, default=4, help="how many of the last checkpoints to average")
    parser.add_argument("--num_samples", type=int, default=8, help="answers sampled per problem (n)")
    parser.add_argument("--ks", default="1", help="comma-separated k of pass@k, each in [1, num_samples]")
    parser.add_argument(
        "--match",
        default="exact",
        choices=("exact", "prefix", "contains"),
        help="when an answer is correct: the completion equals, starts with or contains the row's answer (stripped)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy, n = 1)")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: the newest checkpoint)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--output", default=None, help="also write the JSON result here")
    return parser


def _ks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"`--ks` must be comma-separated integers, got {text!r}.") from None


def read_rows(path: str) -> list[dict]:
    """Rows of a .json list or a .jsonl file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such dataset file: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            rows = [json.loads(line) for line in f if line.strip()] if path.endswith(".jsonl") else json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"`--dataset` {path} is not valid JSON: {err}") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"`--dataset` {path} must hold a non-empty list of rows (objects).")
    missing = {"prompt", "answer"} - set(rows[0])
    if missing:
        raise ValueError(f"`--dataset` rows need 'prompt' and 'answer'; missing {sorted(missing)}.")
    return rows


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..evaluation.map_eval import (
        SCORERS,
        check_pass_at_k_settings,
        evaluate_pass_at_k,
        last_checkpoints,
        load_weights,
        uniform_average,
    )

    ks = check_pass_at_k_settings(_ks(args.ks), args.num_samples, args.temperature, "hf-stable eval")
    for field in ("max_new_tokens", "batch_size"):
        if getattr(args, field) < 1:
            raise ValueError(f"`--{field}` must be >= 1, got {getattr(args, field)}.")
    rows = read_rows(args.dataset)
    checkpoints = last_checkpoints(args.folder, args.num_checkpoints)
    merged = uniform_average([load_weights(c) for c in checkpoints])
    model = AutoModelForCausalLM.from_pretrained(checkpoints[-1], trust_remote_code=False, use_safetensors=True)
    _, unexpected = model.load_state_dict(merged, strict=False)  # missing: tied weights, loaded with the model
    if unexpected:
        raise ValueError(f"The checkpoints hold tensors the model does not have: {sorted(unexpected)[:3]}.")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or checkpoints[-1], trust_remote_code=False)
    scores = evaluate_pass_at_k(
        model,
        tokenizer,
        rows,
        ks=ks,
        num_samples=args.num_samples,
        scorer=SCORERS[args.match],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    return {
        "checkpoints": [os.path.basename(c) for c in checkpoints],
        "num_checkpoints": len(checkpoints),
        "num_samples": args.num_samples,
        "temperature": args.temperature,
        "match": args.match,
        **scores,
    }


def _write_json(path: str, result: dict) -> None:
    write_text_atomic(path, json.dumps(result, indent=2))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Entry point of `hf-stable eval`; returns the exit status. Expected failures print one line."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    try:
        result = run(args)
        if args.output:
            _write_json(args.output, result)
    except (ValueError, FileNotFoundError, OSError) as err:
        if os.environ.get("HF_STABLE_DEBUG"):  # the full traceback, for bug reports
            raise
        print(f"{parser.prog}: error: {err}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

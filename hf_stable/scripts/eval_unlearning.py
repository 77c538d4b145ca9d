"""`hf-stable eval-unlearning`: open-unlearning's TOFU or MUSE metric suite on a model, as JSON and Markdown.

```bash
hf-stable eval-unlearning --model ./unlearned --benchmark tofu --forget_split forget10 --retain_model ./retain90
hf-stable eval-unlearning --model ./unlearned --benchmark tofu --data_dir ./TOFU --retain_logs_path r/TOFU_EVAL.json
hf-stable eval-unlearning --model muse-bench/MUSE-News_target --benchmark muse --corpus News --metrics all
```
Writes ``<BENCH>_EVAL.json`` (per-example values, open-unlearning's layout: usable as another run's
``--retain_logs_path``), ``<BENCH>_SUMMARY.json`` and ``<BENCH>_SUMMARY.md`` into ``--output_dir``. Data come from the
Hub (``locuslab/TOFU``, ``muse-bench/MUSE-News``/``-Books``) or from ``--data_dir``, a folder of the same files.
"""

from __future__ import annotations

import argparse
import os
import sys


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from hf_stable.evaluation.benchmarks import BENCHMARKS, MUSE_REPOS, TOFU_FORGET_SPLITS
    from hf_stable.evaluation.metrics import TRUTH_RATIO_AGGREGATORS
    from hf_stable.evaluation.suites import MUSE_METRICS, TOFU_METRICS

    p = argparse.ArgumentParser(
        prog=prog or "hf-stable eval-unlearning",
        description="Evaluate a model with open-unlearning's TOFU or MUSE metrics (names and semantics).",
    )
    p.add_argument("--model", required=True, help="Model folder or Hub id (safetensors weights).")
    p.add_argument("--benchmark", required=True, choices=BENCHMARKS)
    p.add_argument("--forget_split", default="forget10", help=f"TOFU: one of {', '.join(TOFU_FORGET_SPLITS)}.")
    p.add_argument("--corpus", default="News", help=f"MUSE: one of {', '.join(MUSE_REPOS)}.")
    p.add_argument("--data_dir", default=None, help="Local folder with the benchmark's files (default: the Hub).")
    p.add_argument("--output_dir", default=None, help="Where the report goes (default: eval_<benchmark>).")
    p.add_argument(
        "--metrics",
        default="default",
        help="Comma-separated metric names, `default` (open-unlearning's default set) or `all` (with "
        "mia_reference only given --reference_model). "
        f"TOFU: {', '.join(TOFU_METRICS)}. MUSE: {', '.join(MUSE_METRICS)}.",
    )
    p.add_argument("--retain_model", default=None, help="A model trained without the forget set: evaluated too, it "
                   "gives forget_quality and privleak their reference.")  # fmt: skip
    p.add_argument("--retain_logs_path", default=None, help="Or the *_EVAL.json of such a model (ours or "
                   "open-unlearning's).")  # fmt: skip
    p.add_argument("--reference_model", default=None, help="Reference model of mia_reference.")
    p.add_argument("--tokenizer", default=None, help="Tokenizer folder or Hub id (default: --model's).")
    p.add_argument("--prompt_format", default="auto", choices=("auto", "chat", "plain"),
                   help="chat: the tokenizer's chat template; plain: 'Question: ...\\nAnswer: '; auto: chat when the "
                   "tokenizer has a template.")  # fmt: skip
    p.add_argument("--system_prompt", default=None, help="System message of the chat format.")
    p.add_argument("--truth_ratio_aggregator", default="closer_to_1_better", choices=TRUTH_RATIO_AGGREGATORS,
                   help="forget_truth_ratio's aggregation (prob_mean uses p_true / (p_true + p_false)).")  # fmt: skip
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_length", type=int, default=None, help="Token limit of a text (TOFU 512, MUSE 2048).")
    p.add_argument("--max_new_tokens", type=int, default=None, help="Generation length for every ROUGE metric "
                   "(default: open-unlearning's, TOFU 200, MUSE knowmem 32 and verbmem 128).")  # fmt: skip
    p.add_argument("--mia_k", type=float, default=0.4, help="k of Min-K%% and Min-K%%++ (privleak uses Min-K%%).")
    p.add_argument("--gradnorm_p", default="2", choices=("1", "2", "inf"), help="Norm of mia_gradnorm.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available).")
    p.add_argument("--trust_remote_code", action="store_true", help="Run the model repository's own code.")
    p.add_argument("--allow_pickle", action="store_true", help="Also load .bin (pickle) weights.")
    p.add_argument("--no_progress", action="store_true", help="No progress bars (they only show on a terminal).")
    return p


def _metrics(text: str, benchmark: str, with_reference: bool) -> list[str]:
    from hf_stable.evaluation.suites import MUSE_DEFAULT, MUSE_METRICS, TOFU_DEFAULT, TOFU_METRICS

    default, allowed = (TOFU_DEFAULT, TOFU_METRICS) if benchmark == "tofu" else (MUSE_DEFAULT, MUSE_METRICS)
    if text == "default":
        return list(default)
    if text == "all":  # mia_reference only with a reference model
        return [m for m in allowed if m != "mia_reference" or with_reference]
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in allowed]
    if unknown or not names:
        raise ValueError(f"`metrics`={text!r} is not valid. Allowed values: default, all, {', '.join(allowed)}.")
    return names


def _check(args) -> None:
    from hf_stable._validation import check_choice, check_int, check_number
    from hf_stable.evaluation.benchmarks import MUSE_REPOS, TOFU_FORGET_SPLITS

    if args.benchmark == "tofu":
        check_choice("forget_split", args.forget_split, TOFU_FORGET_SPLITS)
    else:
        check_choice("corpus", args.corpus, MUSE_REPOS)
    check_int("batch_size", args.batch_size, low=1)
    check_int("max_length", args.max_length, low=1, allow_none=True)
    check_int("max_new_tokens", args.max_new_tokens, low=1, allow_none=True)
    check_number("mia_k", args.mia_k, low=0, high=1, low_open=True)
    if args.retain_model and args.retain_logs_path:
        raise ValueError("Give `retain_model` or `retain_logs_path`, not both.")
    for flag in ("model", "retain_model", "reference_model", "tokenizer"):  # a local path, not a Hub id: must exist
        name = getattr(args, flag)
        if name and (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(name):
            raise FileNotFoundError(f"`{flag}` {name!r} is not a folder.")
    if args.retain_logs_path is not None and not os.path.isfile(args.retain_logs_path):
        raise FileNotFoundError(f"`retain_logs_path` {args.retain_logs_path!r} is not a file.")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise FileNotFoundError(f"`data_dir` {args.data_dir!r} is not a folder.")
    args.metric_names = _metrics(args.metrics, args.benchmark, bool(args.reference_model))
    if "mia_reference" in args.metric_names and not args.reference_model:
        raise ValueError("`mia_reference` needs `reference_model`.")


def _load(name: str, args, tokenizer_name: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = dict(dtype=getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code)
    if not args.allow_pickle:
        kwargs["use_safetensors"] = True
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs).to(device)
    if tokenizer_name is None:
        return model
    return model, AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=args.trust_remote_code)


def _options(args, tokenizer):
    from hf_stable.evaluation.suites import EvalOptions

    chat = args.prompt_format == "chat" or (args.prompt_format == "auto" and bool(tokenizer.chat_template))
    if chat and not tokenizer.chat_template:
        raise ValueError("`prompt_format`='chat' needs a tokenizer with a chat template; use `plain`.")
    return EvalOptions(
        chat=chat,
        system_prompt=args.system_prompt,
        batch_size=args.batch_size,
        max_length=args.max_length or (512 if args.benchmark == "tofu" else 2048),
        max_new_tokens=args.max_new_tokens,
        mia_k=args.mia_k,
        gradnorm_p=float(args.gradnorm_p),
        truth_ratio_aggregator=args.truth_ratio_aggregator,
        progress=not args.no_progress,
    )


def _suite(args, model, tokenizer, metrics, options, retain_logs=None, reference=None):
    from hf_stable.evaluation.suites import evaluate_muse, evaluate_tofu

    common = dict(data_dir=args.data_dir, metrics=metrics, options=options, retain_logs=retain_logs)
    if args.benchmark == "tofu":
        return evaluate_tofu(model, tokenizer, forget_split=args.forget_split, reference_model=reference, **common)
    return evaluate_muse(model, tokenizer, corpus=args.corpus, reference_model=reference, **common)


def run(args) -> dict:
    from hf_stable.evaluation.report import read_logs, write_report
    from hf_stable.evaluation.suites import summarize

    output_dir = args.output_dir or f"eval_{args.benchmark}"
    if args.no_progress or not sys.stderr.isatty():  # the libraries' own bars too (loading weights, data)
        import datasets
        from transformers.utils import logging

        logging.disable_progress_bar()
        datasets.disable_progress_bars()
    model, tokenizer = _load(args.model, args, args.tokenizer or args.model)
    options = _options(args, tokenizer)
    retain_logs = read_logs(args.retain_logs_path) if args.retain_logs_path else None
    if args.retain_model:  # the reference side of forget_quality and privleak, saved for later runs
        needs = ["forget_truth_ratio", "mia_min_k"] if args.benchmark == "tofu" else ["mia_min_k"]
        retain_logs = _suite(args, _load(args.retain_model, args), tokenizer, needs, options)
        write_report(os.path.join(output_dir, "retain_model"), args.benchmark, retain_logs, summarize(retain_logs,
                     needs), {"model": args.retain_model})  # fmt: skip
    reference = _load(args.reference_model, args) if args.reference_model else None
    logs = _suite(args, model, tokenizer, args.metric_names, options, retain_logs, reference)
    summary = summarize(logs, args.metric_names)
    settings = {
        "model": args.model,
        "benchmark": args.benchmark,
        "split": args.forget_split if args.benchmark == "tofu" else args.corpus,
        "data": args.data_dir or "Hub",
        "prompt_format": "chat" if options.chat else "plain",
        "truth_ratio_aggregator": options.truth_ratio_aggregator,
        "retain_reference": args.retain_model or args.retain_logs_path or "none: no forget_quality, privleak vs 0.5",
        "mia_k": options.mia_k,
        "dtype": args.dtype,
    }
    paths = write_report(output_dir, args.benchmark, logs, summary, settings)
    for name, value in summary.items():
        print(f"{name}: {value}")
    print(f"report written to {paths['markdown']} and {paths['eval']}")
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Entry point of `hf-stable eval-unlearning`; returns the exit status. Expected failures print one line."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    try:
        _check(args)
        run(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        if os.environ.get("HF_STABLE_DEBUG"):  # the full traceback, for bug reports
            raise
        print(f"{parser.prog}: error: {err}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

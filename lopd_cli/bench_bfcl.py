"""`lopd bench score bfcl --category C --predictions FILE` and `lopd bench run bfcl --category C [--model PATH]`.

score: a predictions JSONL (`id` + `calls`, `text` or `turns`; see lopd_core/bench/bfcl/scoring.py) is
judged by our BFCL checker; accuracy per category goes to stdout and under "bfcl" in metrics/eval.json (merged,
never overwritten). run: the policy answers every test case greedily through its chat template; its answers
are saved as predictions JSONL (one file per category, rescorable with `score`) and scored the same way.
The data folder is `bench.bfcl_dir` (empty: the installed bfcl-eval package's data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from lopd_cli.bench import Benchmark, add_policy_run_args, add_scoring_args, register
from lopd_core.drivers.progress import log
from lopd_core.names import BFCL_CATEGORIES

# The categories, the live and multi-turn families abbreviated (lopd_core/names.py imports nothing: `lopd --help`
# stays free of the benchmark's loaders).
_FAMILIES = ("live_", "multi_turn_")
_HELP_CATEGORIES = ", ".join([c for c in BFCL_CATEGORIES if not c.startswith(_FAMILIES)] + [f"{f}*" for f in _FAMILIES])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir", default=None, help="BFCL data folder (default: bench.bfcl_dir, else the bfcl-eval package's data)"
    )
    p.add_argument("--out", default=None, help="metrics file to merge into (default: eval.out)")


def add_score_args(p: argparse.ArgumentParser) -> None:
    add_scoring_args(p, categories=_HELP_CATEGORIES, predictions="JSONL: id + calls | text | turns")
    _common(p)


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_policy_run_args(
        p,
        categories=_HELP_CATEGORIES,
        default="bench.bfcl_categories",
        limit="first N test cases per category (default: bench.limit)",
        predictions_out="metrics/bfcl_predictions",
        layout="one <category>.jsonl each",
    )
    _common(p)


def _write(params, args, scores: dict, details: dict) -> int:
    from lopd_core.bench.bfcl.scoring import write_scores
    from lopd_core.bench.results import write_details

    out = write_scores(args.out or params.eval.out, scores)
    if getattr(args, "details", None):
        write_details(args.details, {k: v for verdicts in details.values() for k, v in verdicts.items()})
    print(json.dumps({"bfcl": scores, "metrics": str(out)}, indent=2))
    return 0


def score(params, args) -> int:
    from lopd_core.bench.bfcl.data import check_category, load_category, resolve_data_dir
    from lopd_core.bench.bfcl.scoring import score_entries
    from lopd_core.bench.predictions import PredictionError, read_predictions
    from lopd_core.bench.results import accuracy_summary, error_counts

    try:
        categories = [check_category(c) for c in args.category]
        data_dir = resolve_data_dir(args.data_dir if args.data_dir is not None else params.bench.bfcl_dir)
        predictions = read_predictions(args.predictions)
        scores, details = {}, {}
        for category in categories:
            verdicts = score_entries(load_category(category, data_dir), predictions, data_dir, partial=args.partial)
            scores[category] = {**accuracy_summary(verdicts), "errors": error_counts(verdicts)}
            details[category] = verdicts
    except (PredictionError, ValueError) as exc:
        print(f"lopd bench score bfcl: {exc}", file=sys.stderr)
        return 2
    return _write(params, args, scores, details)


def run(params, args) -> int:
    from lopd_core.bench.bfcl.data import check_category
    from lopd_core.bench.bfcl.runner import run_bfcl
    from lopd_core.bench.results import write_jsonl
    from lopd_core.model.loading import load_policy

    try:
        categories = [check_category(c) for c in args.category] if args.category else None
    except ValueError as exc:
        print(f"lopd bench run bfcl: {exc}", file=sys.stderr)
        return 2
    bench = dataclasses.replace(
        params.bench,
        **({"bfcl_dir": args.data_dir} if args.data_dir is not None else {}),
        **({"limit": args.limit} if args.limit is not None else {}),
    )
    model_cfg = dataclasses.replace(params.model, name_or_path=args.model) if args.model else params.model
    model, tokenizer = load_policy(model_cfg)
    started = time.perf_counter()
    scores, records = run_bfcl(
        model,
        tokenizer,
        bench,
        categories=categories,
        log=log,
    )
    for category, rows in records.items():
        write_jsonl(Path(args.predictions_out) / f"{category}.jsonl", rows)
    log(f"bfcl run done in {time.perf_counter() - started:.0f}s; answers in {args.predictions_out}/")
    return _write(params, args, scores, {})


register(
    Benchmark(
        name="bfcl",
        help="Berkeley Function Calling Leaderboard (v3/v4 data)",
        add_score_args=add_score_args,
        score=score,
        add_run_args=add_run_args,
        run=run,
    )
)

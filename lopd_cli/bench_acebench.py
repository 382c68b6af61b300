"""`lopd bench score acebench --category C --language L --predictions FILE` and `lopd bench run acebench`.

score: a predictions JSONL (`id` + `calls` or `text`; special categories need `text`) is judged by our ACEBench
checker; scores per language and category go to stdout and under "acebench" in metrics/eval.json (merged,
never overwritten), with ACEBench's normal and special summaries. run: the policy answers greedily with
ACEBench's prompt protocol; answers are saved as predictions JSONL (one file per language and category) and
scored the same way. The data folder is `bench.acebench_dir` (a copy of ACEBench's data_all/), or --data-dir.
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

_HELP_CATEGORIES = "normal, special, or one category such as normal_atom_bool (agent is not supported)"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="ACEBench data_all/ folder (default: bench.acebench_dir)")
    p.add_argument(
        "--language",
        action="append",
        default=None,
        choices=["en", "zh"],
        help="repeatable (default: bench.acebench_languages)",
    )
    p.add_argument("--out", default=None, help="metrics file to merge into (default: eval.out)")


def add_score_args(p: argparse.ArgumentParser) -> None:
    add_scoring_args(
        p,
        categories=_HELP_CATEGORIES,
        predictions="JSONL: id + calls | text; ids as en/<id> and zh/<id>, or plain with one --language",
    )
    _common(p)


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_policy_run_args(
        p,
        categories=_HELP_CATEGORIES,
        default="bench.acebench_categories",
        limit="first N test cases (conversations) per category",
        predictions_out="metrics/acebench_predictions",
        layout="one <language>/<category>.jsonl each",
    )
    _common(p)


def _write(params, args, scores: dict) -> int:
    from lopd_core.bench.acebench.scoring import write_scores

    out = write_scores(args.out or params.eval.out, scores)
    print(json.dumps({"acebench": scores, "metrics": str(out)}, indent=2, ensure_ascii=False))
    return 0


def _by_language(records: dict[str, dict], languages: list[str]) -> dict[str, dict[str, dict]]:
    """ACEBench ids repeat across languages: a record id is `en/<id>`, `zh/<id>`, or a plain id when one
    language is scored."""
    from lopd_core.bench.predictions import PredictionError

    plain = {k: r for k, r in records.items() if "/" not in k}
    if plain and len(languages) > 1:
        raise PredictionError(
            f"ids such as {next(iter(plain))!r} have no language prefix: prefix them with en/ "
            "or zh/, or score one --language at a time"
        )
    return {
        lang: {**plain, **{k.split("/", 1)[1]: r for k, r in records.items() if k.startswith(f"{lang}/")}}
        for lang in languages
    }


def score(params, args) -> int:
    from lopd_core.bench.acebench.data import expand_categories, load_category, resolve_data_dir
    from lopd_core.bench.acebench.scoring import category_scores, score_entries, with_summaries
    from lopd_core.bench.predictions import PredictionError, read_predictions
    from lopd_core.bench.results import error_counts, write_details

    languages = args.language or params.bench.acebench_languages
    try:
        categories = expand_categories(args.category)
        data_dir = resolve_data_dir(args.data_dir if args.data_dir is not None else params.bench.acebench_dir)
        predictions = _by_language(read_predictions(args.predictions), languages)
        scores, details = {}, {}
        for language in languages:
            scores[language] = {}
            for category in categories:
                entries = load_category(category, language, data_dir)
                verdicts = score_entries(entries, predictions[language], partial=args.partial)
                scores[language][category] = {**category_scores(entries, verdicts), "errors": error_counts(verdicts)}
                details.update({f"{language}/{k}": v for k, v in verdicts.items()})
            with_summaries(scores[language])
    except (PredictionError, ValueError) as exc:
        print(f"lopd bench score acebench: {exc}", file=sys.stderr)
        return 2
    if args.details:
        write_details(args.details, details)
    return _write(params, args, scores)


def run(params, args) -> int:
    from lopd_core.bench.acebench.data import expand_categories
    from lopd_core.bench.acebench.runner import run_acebench
    from lopd_core.bench.results import write_jsonl
    from lopd_core.model.loading import load_policy

    try:
        if args.category:
            expand_categories(args.category)
    except ValueError as exc:
        print(f"lopd bench run acebench: {exc}", file=sys.stderr)
        return 2
    changes = {"acebench_dir": args.data_dir} if args.data_dir is not None else {}
    if args.limit is not None:
        changes["limit"] = args.limit
    bench = dataclasses.replace(params.bench, **changes)
    model_cfg = dataclasses.replace(params.model, name_or_path=args.model) if args.model else params.model
    model, tokenizer = load_policy(model_cfg)
    started = time.perf_counter()
    scores, records = run_acebench(
        model,
        tokenizer,
        bench,
        categories=args.category,
        languages=args.language,
        log=log,
    )
    for name, rows in records.items():
        write_jsonl(Path(args.predictions_out) / f"{name}.jsonl", rows)
    log(f"acebench run done in {time.perf_counter() - started:.0f}s; answers in {args.predictions_out}/")
    return _write(params, args, scores)


register(
    Benchmark(
        name="acebench",
        help="ACEBench tool usage (normal, special; en, zh)",
        add_score_args=add_score_args,
        score=score,
        add_run_args=add_run_args,
        run=run,
    )
)

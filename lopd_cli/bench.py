"""`lopd bench score|run NAME ...`: external benchmarks, one module per benchmark.

Each benchmark module registers itself in BENCHMARKS with a function that adds its options to the `score` and
`run` parsers and the two handlers. The CLI only dispatches; the scoring lives in lopd_core.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """How `lopd bench` reaches one benchmark."""

    name: str
    help: str
    add_score_args: Callable[[argparse.ArgumentParser], None]
    score: Callable[[object, argparse.Namespace], int]  # (params, args) -> exit code
    add_run_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[object, argparse.Namespace], int]


BENCHMARKS: dict[str, Benchmark] = {}


def register(bench: Benchmark) -> Benchmark:
    BENCHMARKS[bench.name] = bench
    return bench


def add_scoring_args(p: argparse.ArgumentParser, *, categories: str, predictions: str) -> None:
    """`score`'s options shared by the benchmarks judged per category (BFCL, ACEBench): which categories, the
    predictions file, scoring only the cases it has, a verdict per case."""
    p.add_argument("--category", action="append", required=True, help=f"repeatable: {categories}")
    p.add_argument("--predictions", required=True, help=predictions)
    p.add_argument("--partial", action="store_true", help="score only the test cases the file has a record for")
    p.add_argument("--details", default=None, help="also write one JSON line per test case (verdict, error) here")


def add_policy_run_args(
    p: argparse.ArgumentParser, *, categories: str, default: str, limit: str, predictions_out: str, layout: str
) -> None:
    """`run`'s options shared by the benchmarks judged per category: which categories (`default`: the `bench`
    setting), the policy, how many cases, where its answers go (`layout`: one file per what)."""
    p.add_argument("--category", action="append", default=None, help=f"repeatable (default: {default}): {categories}")
    p.add_argument("--model", default=None, help="policy directory or hub id (default: model.name_or_path / base_dir)")
    p.add_argument("--limit", type=int, default=None, help=limit)
    p.add_argument("--predictions-out", default=predictions_out, help=f"folder for the model's answers, {layout}")


def _load_all() -> None:
    """Import the benchmark modules that exist (each registers itself)."""
    import importlib

    for module in ("lopd_cli.bench_humaneval", "lopd_cli.bench_bfcl", "lopd_cli.bench_acebench"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def add_bench_parser(sub, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `bench score NAME` and `bench run NAME` to the top-level subparsers."""
    _load_all()
    bench = sub.add_parser("bench", help="score predictions on, or run a model through, an external benchmark")
    actions = bench.add_subparsers(dest="bench_action", required=True)
    for action in ("score", "run"):
        p = actions.add_parser(action, help=f"{action} a benchmark")
        names = p.add_subparsers(dest="bench_name", required=True)
        for b in BENCHMARKS.values():
            q = names.add_parser(b.name, help=b.help)
            add_common(q)
            (b.add_score_args if action == "score" else b.add_run_args)(q)
            q.set_defaults(func=b.score if action == "score" else b.run)

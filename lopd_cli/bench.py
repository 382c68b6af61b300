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

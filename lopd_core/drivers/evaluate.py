"""The evaluate stage's driver: load the policy at `model.name_or_path` (the base when empty), evaluate it on every
environment of the mix and `eval.benchmarks`, write eval.json and, beside it, the per-task outcomes
(`<stem>_tasks.parquet`, lopd_core/outcomes.py). `lopd evaluate` (sharded or not), the cycle's
evaluate task and `lopd compare`'s final evaluation call it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lopd_core.config import Params
from lopd_core.evaluation import EvalShard, eval_shards, evaluate_stage, write_metrics
from lopd_core.model.loading import load_policy
from lopd_core.outcomes import outcomes_path, write_outcomes


def run_evaluate(
    params: Params, out: str | Path, log=print, *, map_shards: Callable[[list[EvalShard]], list[dict]] | None = None
) -> dict:
    """The results of the policy params.model names (DESIGN §5 layout), also written to `out`. `map_shards`: how
    the shards are rolled out when not one after the other in this process (`lopd evaluate --task-runner` maps
    them as Prefect tasks, each worker loading the policy itself); the results are the same."""
    if map_shards is None or params.eval.benchmarks:  # the benchmarks run here, on this process's policy
        model, tokenizer = load_policy(params.model)
    else:
        model = tokenizer = None
    summaries = None if map_shards is None else map_shards(eval_shards(params))
    results, outcomes = evaluate_stage(model, tokenizer, params, log=log, shard_summaries=summaries)
    del model  # a caller that evaluates several policies holds one at a time
    write_metrics(results, out)
    write_outcomes(outcomes, outcomes_path(out))
    log(f"evaluate: {Path(out)} (per task: {outcomes_path(out)})")
    return results

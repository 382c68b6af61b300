"""The evaluate stage's driver: load the policy at `model.name_or_path` (the base when empty), evaluate it on every
environment of the mix and `eval.benchmarks`, write eval.json.

`lopd evaluate --task-runner` runs the same shards (lopd_core.evaluation.evaluate_shard) as mapped Prefect tasks
and assembles the same results; everything else calls this function.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.config import Params
from lopd_core.evaluation import evaluate_stage, write_metrics
from lopd_core.model.loading import load_policy


def run_evaluate(params: Params, out: str | Path, log=print) -> dict:
    """The results of the policy params.model names (DESIGN §5 layout), also written to `out`."""
    model, tokenizer = load_policy(params.model)
    results = evaluate_stage(model, tokenizer, params, log=log)  # eval.benchmarks too; none by default
    del model  # a caller that evaluates several policies holds one at a time
    write_metrics(results, out)
    log(f"evaluate: {Path(out)}")
    return results

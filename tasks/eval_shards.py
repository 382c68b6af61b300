"""Evaluation shards as Prefect tasks: one task per (environment, split ± experience, decoding mode).

Why shards: evaluation is the embarrassingly parallel part of a cycle (hundreds of independent rollouts per
shard), and a shard's requests and seed depend on nothing but params (lopd_core.evaluation.EvalShard), so a task
runner — threads here, a Dask or Ray cluster through prefect-dask / prefect-ray — can place them anywhere and the
assembled results are exactly those of the in-process `evaluate`.

Tasks take params and a shard and return the shard's small summary dict: no model crosses a process boundary.
Each process loads the policy once (cached by its path) and shares it between the threads that run shards.
"""

from __future__ import annotations

import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from lopd_core.config import Params
from lopd_core.drivers.progress import log
from lopd_core.evaluation import EvalShard, evaluate_shard

_POLICIES: dict[str, tuple] = {}
_LOCK = threading.Lock()


def _policy(params: Params):
    """(model, tokenizer) of params.model, loaded once per process (shards of one run share the policy)."""
    from lopd_core.model.loading import load_policy, model_path

    key = f"{model_path(params.model)}|{params.model.dtype}|{params.model.device}"
    with _LOCK:
        if key not in _POLICIES:
            _POLICIES[key] = load_policy(params.model)
        return _POLICIES[key]


@task(name="evaluate-shard", task_run_name="eval-{shard.env}-{shard.variant}-{shard.mode}", cache_policy=NO_CACHE)
def evaluate_shard_task(params: Params, shard: EvalShard) -> dict:
    """Roll out one shard. Not retried: a shard is deterministic (same seed, same result), so a failure in it
    fails again; rerun the command after fixing its cause."""
    model, tokenizer = _policy(params)
    return evaluate_shard(model, tokenizer, params, shard, log=log)

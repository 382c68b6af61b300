"""The cycle's promotion gate over the evaluate stage's outputs: the rule of lopd_core/gate.py, applied to the
per-task outcomes of champion and student, with more batches of fresh tasks when `eval.sequential` asks for them.

Champion and student are evaluated under the same params, so they play the same tasks with the same sampling
seeds (lopd_core/evaluation.py): their outcomes pair task by task. A later look (batch k >= 1) evaluates both
again on `eval.batch` = k, restricted to what the gate reads (its splits and the guards', its mode, no
experience in context, no benchmarks); each look is a cached evaluate stage like the first.
"""

from __future__ import annotations

import dataclasses

from flows import stage_flows as S
from lopd_core.config import Params
from lopd_core.gate import GateDecision, GateRule, resolvable_gain, rule_from, sequential_decide
from lopd_core.outcomes import read_outcomes


def gate_rule(params: Params) -> GateRule:
    return rule_from(params.cycle, list(params.envs.mix))


def looks(params: Params) -> int:
    """How many batches the gate may play: 1 unless `eval.sequential`."""
    ev = params.eval
    return max(1, ev.max_n // ev.n_per_split) if ev.sequential else 1


def resolvable_before(params: Params) -> tuple[float, int]:
    """(the smallest gain the first look can resolve, its paired tasks), stated before the evaluation: the gate
    averages its cells, each of `eval.n_per_split` tasks."""
    cells = len(params.envs.mix) * len([s for s in params.cycle.gate_splits if s in params.eval.splits])
    n = params.eval.n_per_split * max(cells, 1)
    level = params.cycle.confidence
    adjusted = 1 - (1 - level) / looks(params)
    return resolvable_gain(n, min_gain=params.cycle.min_gain, level=adjusted), n


def batch_params(params: Params, batch: int) -> Params:
    """The evaluation params of look `batch` >= 1: fresh tasks, only what the gate and its guards read."""
    rule = gate_rule(params)
    splits = {*rule.splits, *(split for guard in rule.guards for _, split in guard.cells)}
    ev = dataclasses.replace(
        params.eval,
        batch=batch,
        splits=[s for s in params.eval.splits if s in splits],
        modes=[rule.mode],
        with_experience=False,
        benchmarks=[],
        teacher_splits=[],
    )
    return dataclasses.replace(params, eval=ev)


def decide_promotion(
    params: Params, champion: str, student: str, first: tuple[dict, dict], *, common: dict
) -> tuple[GateDecision, list[dict]]:
    """The gate's decision, and the evaluations of every look after the first (for the record). `first`: the
    evaluate flows' summaries of champion and student on batch 0."""
    extra: list[dict] = []

    def play(k: int):
        if k == 0:
            pair = first
        else:
            p = batch_params(params, k)
            pair = (
                S.evaluate_flow(p, champion, label=f"champion-batch{k}", **common),
                S.evaluate_flow(p, student, label=f"student-batch{k}", **common),
            )
            extra.extend(pair)
        return read_outcomes(pair[0]["outcomes"]), read_outcomes(pair[1]["outcomes"])

    decision = sequential_decide(play, gate_rule(params), looks=looks(params), seed=params.seed)
    return decision, extra

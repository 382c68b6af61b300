"""The cycle's promotion gate over the evaluate stage's outputs: the rule of lopd_core/gate.py, applied to the
per-task outcomes of champion, student and the lineage's root, with more batches of fresh tasks when
`eval.sequential` asks for them.

Champion, student and root (the first base) are evaluated under the same params, so they play the same tasks with
the same sampling seeds (lopd_core/evaluation.py): their outcomes pair task by task. The root is evaluated every
cycle already (the report's first column; a cached stage, so the same outcomes each cycle while the held-out tasks
are the same); while the champion is the root, its evaluation is the root's. A later look (batch k >= 1) evaluates
champion, student and root again on `eval.batch` = k, restricted to what the gate reads (its splits and the
guards', its mode, no experience in context, no benchmarks); each look is a cached evaluate stage like the first.
"""

from __future__ import annotations

import dataclasses

from flows import stage_flows as S
from lopd_core.config import Params
from lopd_core.gate import (
    GateDecision,
    GateRule,
    Played,
    detectable_gain,
    resolvable_gain,
    rule_from,
    sequential_decide,
)
from lopd_core.outcomes import read_outcomes


def gate_rule(params: Params) -> GateRule:
    return rule_from(params.cycle, list(params.envs.mix))


def looks(params: Params) -> int:
    """How many batches the gate may play: 1 unless `eval.sequential`."""
    ev = params.eval
    return max(1, ev.max_n // ev.n_per_split) if ev.sequential else 1


def resolvable_before(params: Params) -> tuple[float, int, float]:
    """(the smallest observed gain the first look can promote, its paired tasks, the true gain it promotes with
    90 % power), stated before the evaluation: the gate averages its cells, each of `eval.n_per_split` tasks."""
    cells = len(params.envs.mix) * len([s for s in params.cycle.gate_splits if s in params.eval.splits])
    n = params.eval.n_per_split * max(cells, 1)
    alpha = dataclasses.replace(gate_rule(params), looks=looks(params)).gain_alpha
    min_gain = params.cycle.min_gain
    return resolvable_gain(n, min_gain=min_gain, alpha=alpha), n, detectable_gain(n, min_gain=min_gain, alpha=alpha)


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
    params: Params, models: dict[str, str], first: dict[str, dict], *, common: dict
) -> tuple[GateDecision, list[dict]]:
    """The gate's decision, and the evaluations of every look after the first (for the record). `models` and
    `first`: the weights of champion, student and root, and their evaluate flows' summaries on batch 0."""
    extra: list[dict] = []
    root_is_champion = models["root"] == models["champion"]

    def play(k: int) -> Played:
        summaries = first
        if k >= 1:
            p = batch_params(params, k)
            summaries = {
                who: S.evaluate_flow(p, models[who], label=f"{who}-batch{k}", **common)
                for who in ("champion", "student", *(() if root_is_champion else ("root",)))
            }
            extra.extend(summaries.values())
        frames = {who: read_outcomes(summary["outcomes"]) for who, summary in summaries.items()}
        return Played(frames["champion"], frames["student"], frames.get("root", frames["champion"]))

    decision = sequential_decide(play, gate_rule(params), looks=looks(params), seed=params.seed)
    return decision, extra

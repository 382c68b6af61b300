"""The cycle's promotion gate: the rule of lopd_core/gate.py, applied to the per-task outcomes of champion, student
and the lineage's root on a batch of held-out tasks no earlier decision read, with more such batches when
`eval.sequential` asks for them.

Fresh tasks for every decision. The report's evaluation (flows/cycle.py `evaluate_cycle`) plays `eval.batch` 0,
every cycle the same tasks, so the lineage's bars compare on the same tasks; the gate never reads it. Each look of
the gate plays a batch of its own, k >= 1: the first batch after batch 0 and after every task an earlier cycle's
gate played (`gate_start`, from history.json's records), so with the defaults (one look) cycle c plays batch c,
and with K looks that all run, cycle c's look j (from 0) plays batch 1 + (c − 1)·K + j. A cycle's record keeps
the batches and the instances it played (`gate.batches`, `gate.tasks`).

Pairing holds within a look: champion, student and root are evaluated under the same params (the same `eval.batch`,
splits, mode and seed), so they play the same tasks with the same sampling seeds (lopd_core/evaluation.py) and their
outcomes pair task by task. While the champion is the root, its evaluation is the root's. A look's evaluation is
restricted to what the gate reads: its splits and the guards', its mode, no experience in context, no benchmarks,
never test_final (read by no decision) — each a cached evaluate stage, so a cycle run again reuses them.

When the cycles outrun a split: a built-in's task streams are unbounded, a task file's held-out split is not
(lopd_core/evaluation.py `batch_tasks`); a cycle whose gate would need tasks beyond a split stops before any
stage runs with an error naming the split and the fix (`check_fresh_tasks`), rather than wrapping round to tasks
an earlier decision read.
"""

from __future__ import annotations

import dataclasses

from flows import stage_flows as S
from lopd_core.config import Params
from lopd_core.evaluation import check_batch
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
from lopd_core.settings.run import FINAL_SPLIT


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


def gate_start(history: list[dict], n_per_split: int) -> int:
    """The first batch this cycle's gate plays: the first whole batch of `n_per_split` tasks after batch 0 (the
    report's) and after every instance an earlier cycle's gate played (its record's `gate.tasks`, [first, end)).
    A record from before fresh batches read batch 0 and its later looks: [0, looks · n)."""
    end = n_per_split
    for record in history:
        gate = record.get("gate") or {}
        end = max(end, gate["tasks"][1] if "tasks" in gate else gate.get("looks", 1) * n_per_split)
    return -(-end // n_per_split)


def batch_params(params: Params, batch: int) -> Params:
    """The evaluation params of the gate's batch `batch` >= 1: fresh tasks, only what the gate and its guards read
    (never test_final, which no decision reads)."""
    rule = gate_rule(params)
    splits = {*rule.splits, *(split for guard in rule.guards for _, split in guard.cells)} - {FINAL_SPLIT}
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


def check_fresh_tasks(params: Params, start: int) -> None:
    """Before a cycle's first stage: every split the gate reads can fill the last batch its looks may play (a
    ConfigError naming the split and the fix otherwise; lopd_core/evaluation.py `batch_tasks`)."""
    check_batch(batch_params(params, start + looks(params) - 1))


def decide_promotion(
    params: Params, models: dict[str, str], *, start: int, common: dict
) -> tuple[GateDecision, list[dict], list[int]]:
    """The gate's decision, the evaluations of its looks (for the record) and the batches they played. `models`:
    the weights of champion, student and root; `start`: the first batch (`gate_start`)."""
    evaluations: list[dict] = []
    root_is_champion = models["root"] == models["champion"]

    def play(k: int) -> Played:
        p = batch_params(params, start + k)
        summaries = {
            who: S.evaluate_flow(p, models[who], label=f"{who}-gate-batch{start + k}", **common)
            for who in ("champion", "student", *(() if root_is_champion else ("root",)))
        }
        evaluations.extend(summaries.values())
        frames = {who: read_outcomes(summary["outcomes"]) for who, summary in summaries.items()}
        return Played(frames["champion"], frames["student"], frames.get("root", frames["champion"]))

    decision = sequential_decide(play, gate_rule(params), looks=looks(params), seed=params.seed)
    return decision, evaluations, [start + k for k in range(decision.looks)]

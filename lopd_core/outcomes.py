"""Per-task outcomes of an evaluation: one row per played task, beside eval.json as `<stem>_tasks.parquet`.

Why: eval.json holds one rate per environment, split and mode, which is all a report needs but too little for a
decision. Two policies played on the same tasks with the same sampling seeds (the evaluation draws both from one
seeded stream, lopd_core/evaluation.py) can be compared task by task, and a paired difference is far less noisy
than the difference of two rates (lopd_core/gate.py). The schema guards that pairing: a duplicated task id in a
cell, or a success with a reward below 1, would bias the gate silently.

Columns: env, split (with `+experience` when played with experience in context), mode, task_id, template (the
cluster tasks share), world, success, reward, turns, tokens (action tokens the policy sampled), batch (which batch
of fresh tasks, `eval.batch`). Benchmarks (eval.benchmarks) keep their own scores and have no rows here.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from lopd_core.outputs import atomic_write

OUTCOME_COLUMNS = ("env", "split", "mode", "task_id", "template", "world", "success", "reward", "turns", "tokens")

OUTCOME_SCHEMA = pa.DataFrameSchema(
    {
        "env": pa.Column(str),
        "split": pa.Column(str),
        "mode": pa.Column(str, pa.Check.isin(["greedy", "sampled"])),
        "task_id": pa.Column(str),
        "template": pa.Column(str),
        "world": pa.Column(str),
        "success": pa.Column(bool),
        "reward": pa.Column(float, pa.Check.in_range(0.0, 1.0)),
        "turns": pa.Column(int, pa.Check.ge(0)),
        "tokens": pa.Column(int, pa.Check.ge(0)),
        "batch": pa.Column(int, pa.Check.ge(0)),
    },
    checks=[
        pa.Check(lambda df: ~df["success"] | (df["reward"] == 1.0), error="success with reward < 1"),
        pa.Check(
            lambda df: ~df.duplicated(["env", "split", "mode", "task_id"], keep=False),
            error="a task played twice in one cell (env, split, mode): the pairing would be ambiguous",
        ),
    ],
    strict=True,
    coerce=False,
)


def outcomes_path(eval_path: str | Path) -> Path:
    """Where the per-task outcomes of the eval.json at `eval_path` live: metrics/eval.json ->
    metrics/eval_tasks.parquet."""
    path = Path(eval_path)
    return path.with_name(f"{path.stem}_tasks.parquet")


def outcome_rows(env: str, split: str, mode: str, trajectories, batch: int = 0) -> list[dict]:
    """One row per trajectory of a shard (plain values, so a Prefect task can return them)."""
    return [
        {
            "env": env,
            "split": split,
            "mode": mode,
            "task_id": t.task.task_id,
            "template": t.task.template,
            "world": t.task.world,
            "success": bool(t.success),
            "reward": float(t.reward),
            "turns": int(t.num_turns),
            "tokens": int(sum(t.action_mask)),
            "batch": int(batch),
        }
        for t in trajectories
    ]


def outcomes_frame(rows: list[dict]) -> pd.DataFrame:
    """The validated frame of `rows` (lazy: the error lists every failing row and check)."""
    frame = pd.DataFrame(rows, columns=[*OUTCOME_COLUMNS, "batch"])
    if frame.empty:  # an empty frame's columns are objects: give them the schema's types
        frame = frame.astype({name: column.dtype.type for name, column in OUTCOME_SCHEMA.columns.items()})
    return OUTCOME_SCHEMA.validate(frame, lazy=True)


def write_outcomes(rows: list[dict], path: str | Path) -> Path:
    """Validate and write the rows as parquet, atomically."""
    frame = outcomes_frame(rows)
    with atomic_write(path) as fh:  # a crash never leaves half a table behind
        frame.to_parquet(fh, index=False)
    return Path(path)


def read_outcomes(path: str | Path) -> pd.DataFrame:
    """The validated frame of a written outcomes file."""
    return OUTCOME_SCHEMA.validate(pd.read_parquet(path), lazy=True)

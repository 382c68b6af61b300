"""Trajectory tables: rollouts as a pandas frame guarded by a pandera schema, saved as parquet.

Why a schema: trajectories feed the experience bank and training; a row whose mask and ids disagree in length,
or whose reward leaves [0, 1], would poison both silently. Validation is lazy, so the error lists every failing
row and check at once instead of the first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from lopd_core.outputs import atomic_write
from lopd_core.rollout.engine import Trajectory


def _lengths_agree(df: pd.DataFrame) -> pd.Series:
    return (df["token_ids"].map(len) == df["action_mask"].map(len)) & (
        df["token_ids"].map(len) == df["sample_logprobs"].map(len)
    )


def _mask_is_binary(mask) -> bool:
    return all(m in (0, 1) for m in mask)


TRAJECTORY_SCHEMA = pa.DataFrameSchema(
    {
        "task_id": pa.Column(str),
        "env": pa.Column(str),
        "split": pa.Column(str, pa.Check.isin(["train", "test_id", "test_ood"])),
        "template": pa.Column(str),
        "world": pa.Column(str),
        "sample_index": pa.Column(int, pa.Check.ge(-1)),  # -1: an oracle demonstration, not a policy sample
        "token_ids": pa.Column(object, pa.Check(lambda s: s.map(len) > 0, element_wise=False)),
        "action_mask": pa.Column(object, pa.Check(_mask_is_binary, element_wise=True)),
        "sample_logprobs": pa.Column(object, pa.Check(lambda lp: all(v <= 1e-6 for v in lp), element_wise=True)),
        "prompt_length": pa.Column(int, pa.Check.gt(0)),
        "reward": pa.Column(float, pa.Check.in_range(0.0, 1.0)),
        "success": pa.Column(bool),
        "stop_reason": pa.Column(str, pa.Check.isin(["answer", "turn_limit", "context_limit"])),
        "num_turns": pa.Column(int, pa.Check.ge(1)),
        "episode": pa.Column(str),  # JSON list of the environment's per-turn records
        "experiences": pa.Column(str),  # JSON list of the success texts in the first user turn
        "task": pa.Column(str),  # Task JSON, so a row rebuilds its episode
    },
    checks=[
        pa.Check(_lengths_agree, error="token_ids, action_mask and sample_logprobs differ in length"),
        pa.Check(lambda df: ~df["success"] | (df["reward"] == 1.0), error="success with reward < 1"),
    ],
    strict=True,
    coerce=False,
)


def trajectories_to_frame(trajectories: list[Trajectory]) -> pd.DataFrame:
    rows = [
        {
            "task_id": t.task.task_id,
            "env": t.task.env,
            "split": t.task.split,
            "template": t.task.template,
            "world": t.task.world,
            "sample_index": int(t.sample_index),
            "token_ids": list(t.token_ids),
            "action_mask": list(t.action_mask),
            "sample_logprobs": [float(v) for v in t.sample_logprobs],
            "prompt_length": int(t.prompt_length),
            "reward": float(t.reward),
            "success": bool(t.success),
            "stop_reason": t.stop_reason,
            "num_turns": int(t.num_turns),
            "episode": json.dumps(t.episode),
            "experiences": json.dumps(list(t.experiences)),
            "task": t.task.to_json(),
        }
        for t in trajectories
    ]
    return validate_trajectories(pd.DataFrame(rows, columns=list(TRAJECTORY_SCHEMA.columns)))


def validate_trajectories(frame: pd.DataFrame) -> pd.DataFrame:
    """Validate lazily: a SchemaErrors lists every failure case, not just the first."""
    return TRAJECTORY_SCHEMA.validate(frame, lazy=True)


def write_trajectories(frame: pd.DataFrame, path: str | Path) -> Path:
    path = Path(path)
    with atomic_write(path) as fh:  # a crash never leaves half a table behind
        validate_trajectories(frame).to_parquet(fh, index=False)
    return path


def read_trajectories(path: str | Path) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    for col in ("token_ids", "action_mask", "sample_logprobs"):
        frame[col] = frame[col].map(list)
    return validate_trajectories(frame)

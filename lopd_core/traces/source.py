"""Traces as training input: a store folder or a snapshot file, read as the rollout table and as Trajectories.

What the cycle reads from served traffic (`lopd.traces`): either the store `lopd serve` writes (a folder of
segments) or a parquet snapshot of it (`lopd serve snapshot`). The bank takes the labeled successes; distillation
takes the labeled traces as trajectories (lopd_core/distill/loop/trace_source.py). Rows come sorted by trajectory id, so
the same traces give the same order whatever order the store appended them in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lopd_core.envs import Task
from lopd_core.rollout.engine import Trajectory
from lopd_core.settings.checks import ConfigError
from lopd_core.traces.errors import TraceStoreError
from lopd_core.traces.schema import traces_as_trajectories
from lopd_core.traces.store import read_snapshot, read_traces


def load_traces(path: str | Path) -> pd.DataFrame:
    """The validated trace table at `path`: a store folder or a snapshot parquet file. What a careless setting
    names (no such path, a file that is no parquet snapshot, a store a reader refuses) is one ConfigError naming
    lopd.traces, which the command line prints as one line."""
    path = Path(path)
    if not str(path) or not path.exists():
        raise FileNotFoundError(
            f"no traces at {path!s}: point lopd.traces at a `lopd serve` store folder or a "
            "snapshot file (`lopd serve snapshot --out FILE`)"
        )
    if path.is_file():
        try:
            return read_snapshot(path)
        except (OSError, ValueError, KeyError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(
                f"lopd.traces: {path} is not a trace snapshot ({type(exc).__name__}): name a `lopd serve` store "
                "folder or a file `lopd serve snapshot --out FILE` wrote"
            ) from None
    try:
        return read_traces(path)
    except TraceStoreError as exc:
        raise ConfigError(f"lopd.traces: {exc}") from None


def require_labeled(path: str | Path) -> int:
    """The number of labeled traces at `path`; a ConfigError when there is none, so a command that learns from
    traces stops before any work (a cold start, a rollout) instead of failing minutes later."""
    traces = load_traces(path)
    labeled = int(traces["labeled"].sum())
    if labeled == 0:
        raise ConfigError(
            f"lopd.traces: no labeled trace at {path} ({len(traces)} traces, none with feedback): post feedback "
            "for the served conversations (POST /v1/feedback; `lopd serve client` does) or train on rollouts"
        )
    return labeled


def trace_table(path: str | Path, *, labeled_only: bool = True) -> pd.DataFrame:
    """The traces at `path` as rows of the rollout table, sorted by trajectory id (index reset)."""
    frame = traces_as_trajectories(load_traces(path), labeled_only=labeled_only)
    return frame.sort_values("task_id", kind="stable").reset_index(drop=True)


def as_trajectories(frame: pd.DataFrame) -> list[Trajectory]:
    """Rows of the rollout table back as Trajectories (what a training step consumes)."""
    return [
        Trajectory(
            task=Task.from_json(r.task),
            sample_index=int(r.sample_index),
            experiences=tuple(json.loads(r.experiences)),
            token_ids=[int(i) for i in r.token_ids],
            action_mask=[int(m) for m in r.action_mask],
            sample_logprobs=[float(v) for v in r.sample_logprobs],
            prompt_length=int(r.prompt_length),
            reward=float(r.reward),
            success=bool(r.success),
            stop_reason=str(r.stop_reason),
            num_turns=int(r.num_turns),
            episode=json.loads(r.episode),
        )
        for r in frame.itertuples(index=False)
    ]

"""The trajectory table's schema rejects bad rows and lists every failure, not just the first."""

import pandera.errors
import pytest

from lopd_core.envs import make_tasks
from lopd_core.rollout.engine import Trajectory
from lopd_core.rollout.table import trajectories_to_frame, validate_trajectories


def _traj(task, **over):
    base = {
        "task": task,
        "sample_index": 0,
        "experiences": (),
        "token_ids": [1, 2, 3, 4],
        "action_mask": [0, 0, 1, 1],
        "sample_logprobs": [0.0, 0.0, -0.5, -0.1],
        "prompt_length": 2,
        "reward": 1.0,
        "success": True,
        "stop_reason": "answer",
        "num_turns": 1,
        "episode": [{"action": "done"}],
    }
    base.update(over)
    return Trajectory(**base)


def test_good_rows_pass():
    (task,) = make_tasks("toolworld", "train", 1, seed=0)
    frame = trajectories_to_frame([_traj(task), _traj(task, reward=0.5, success=False)])
    assert len(frame) == 2


def test_every_bad_row_is_reported():
    (task,) = make_tasks("toolworld", "train", 1, seed=0)
    good = trajectories_to_frame([_traj(task)])
    bad = good.copy()
    bad = bad.loc[[0, 0, 0, 0]].reset_index(drop=True)
    bad.at[0, "reward"] = 1.5  # reward out of range
    bad.at[1, "action_mask"] = [0, 0, 1]  # length disagrees with token_ids
    bad.at[2, "action_mask"] = [0, 2, 1, 1]  # not a mask
    bad.at[3, "success"] = True
    bad.at[3, "reward"] = 0.25  # success with reward < 1
    with pytest.raises(pandera.errors.SchemaErrors) as info:
        validate_trajectories(bad)
    cases = info.value.failure_cases
    checks = set(cases["check"].astype(str))
    columns = set(cases["column"].dropna().astype(str))
    assert {"reward", "action_mask"} <= columns
    assert any("in_range" in c for c in checks)
    assert "token_ids, action_mask and sample_logprobs differ in length" in checks
    assert "success with reward < 1" in checks
    # Rows 0..3 each fail something: all are named, not only the first.
    assert {0, 1, 2, 3} <= set(cases["index"].dropna().astype(int))

"""Shared, cached task sets for the toolworld tests (kept small so the suite stays fast)."""

from __future__ import annotations

from functools import cache

from lopd_core.envs import TEMPLATES, WORLDS, make_tasks

N_TRAIN = sum(t.split_group == "train" for t in TEMPLATES.values())
N_OOD = sum(t.split_group == "ood" for t in TEMPLATES.values())


@cache
def tasks(split: str, rounds: int = 1, seed: int = 0):
    """``rounds`` full cycles of templates x worlds for a split."""
    per_round = (N_OOD if split == "test_ood" else N_TRAIN) * len(WORLDS)
    return tuple(make_tasks("toolworld", split, per_round * rounds, seed))


def all_tasks():
    return tasks("train") + tasks("test_id") + tasks("test_ood")

"""The content partition of the built-in environments' splits (lopd_core/envs/held_out.py): train, val, test_id and
test_final disjoint by content, whatever the seeds; test_id, test_ood and pretrain_test exactly the tasks they were."""

from __future__ import annotations

import hashlib
import json

import pytest

from lopd_core.config import Params
from lopd_core.envs import make_tasks
from lopd_core.envs.codegen.tasks import task_content_key as codegen_key
from lopd_core.envs.held_out import CARVE, TEST_BUCKETS, content_part
from lopd_core.envs.toolworld.tasks import task_content_key as toolworld_key
from lopd_core.envs.toolworld.worlds import WorldSplit

KEY = {"toolworld": toolworld_key, "codegen": codegen_key}
PARTITIONED = ("train", "val", "test_id", "test_final")
PART = {"train": "train", "val": "val", "test_id": "test", "test_final": "test_final"}


def _content(t):
    return (t.env, t.template, t.world, t.instruction, json.dumps(t.spec, sort_keys=True))


def test_the_partition_by_hand():
    """key % 8 == 0: a test's; else the high half mod 32: 0 val, 1 test_final, the rest train."""
    assert content_part(0) == "test" and content_part(TEST_BUCKETS * 12345) == "test"
    assert content_part(1) == "val"  # high half 0
    assert content_part((1 << 32) + 3) == "test_final"
    assert content_part((2 << 32) + 3) == "train" and content_part(((CARVE + 1) << 32) + 5) == "test_final"
    assert content_part(8 + (1 << 32)) == "test"  # the test bucket wins whatever the high half says


@pytest.mark.parametrize("env", ["toolworld", "codegen"])
def test_every_split_holds_only_its_part_and_the_splits_share_no_task(env):
    """Each drawn task's content key falls in its split's part, so no task of one split can be another's; checked
    on the tasks too, across two seeds (the evaluation's stream and a training-like one)."""
    seen: dict[str, set] = {}
    for seed in (0, 1_000_003):
        for split in PARTITIONED:
            tasks = make_tasks(env, split, 48, seed)
            assert {t.split for t in tasks} == {split}
            assert {content_part(KEY[env](t)) for t in tasks} == {PART[split]}, (env, split, seed)
            seen.setdefault(split, set()).update(_content(t) for t in tasks)
    for a in PARTITIONED:
        for b in PARTITIONED:
            if a < b:
                assert not seen[a] & seen[b], (env, a, b)
    # val and test_final are the training distribution: the same templates (families) as train and test_id
    templates = {s: {c[1] for c in seen[s]} for s in PARTITIONED}
    assert templates["val"] == templates["test_final"] == templates["train"] == templates["test_id"]


def test_val_and_test_final_are_drawn_in_the_deployment_worlds():
    splits = WorldSplit.from_config(Params().envs)
    for split in ("val", "test_final", "test_id"):
        assert splits.for_split(split) == splits.deploy
    assert splits.for_split("pretrain_test") == splits.pretrain


# sha256 of the first 60 tasks' JSON of each split at the evaluation's seed, before the partition gained val and
# test_final (commit 3c1cab2): test_id, test_ood and pretrain_test are the tasks every earlier figure was measured on.
BEFORE = {
    ("toolworld", "test_id"): "e838e2461d10aa68",
    ("toolworld", "test_ood"): "4ea84153c2be54e6",
    ("toolworld", "pretrain_test"): "5e9b82627c7acb0a",
    ("codegen", "test_id"): "5181fca1b3df55c7",
    ("codegen", "test_ood"): "263d79aa37a917f2",
    ("codegen", "pretrain_test"): "5dadf43a4f7fb69d",
}


@pytest.mark.parametrize(("env", "split"), list(BEFORE))
def test_the_test_splits_are_the_tasks_they_were(env, split):
    worlds = WorldSplit.from_config(Params().envs).for_split(split)
    tasks = make_tasks(env, split, 60, 1_000_003, worlds)
    digest = hashlib.sha256("\n".join(t.to_json() for t in tasks).encode()).hexdigest()[:16]
    assert digest == BEFORE[(env, split)]

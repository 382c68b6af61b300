"""The content partition of the built-in environments' splits (lopd_core/envs/held_out.py): in the deployment task
sets train, val, test_id and test_final disjoint by content, whatever the seeds; test_id, test_ood and pretrain_test
exactly the tasks they were, and so the pretraining stream's train tasks (the shipped base's warm-start data)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from lopd_core.config import Params
from lopd_core.distill.composer.coldstart_data import COLDSTART_SEED_OFFSET
from lopd_core.envs import make_tasks
from lopd_core.envs.codegen.tasks import task_content_key as codegen_key
from lopd_core.envs.held_out import CARVE, TEST_BUCKETS, content_part
from lopd_core.envs.mix import pretraining_tasks
from lopd_core.envs.toolworld.tasks import task_content_key as toolworld_key
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.model.codegen_demos import codegen_demo_tasks
from lopd_core.model.demos import build_demos, demo_tasks

KEY = {"toolworld": toolworld_key, "codegen": codegen_key}
PARTITIONED = ("train", "val", "test_id", "test_final")
PART = {"train": "train", "val": "val", "test_id": "test", "test_final": "test_final"}


def _content(t):
    return (t.env, t.template, t.world, t.instruction, json.dumps(t.spec, sort_keys=True))


def test_the_partition_by_hand():
    """key % 8 == 0: a test's; else, in a deployment set, the high half mod 32: 0 val, 1 test_final, the rest train."""
    assert content_part(0) == "test" and content_part(TEST_BUCKETS * 12345) == "test"
    assert content_part(1) == "val"  # high half 0
    assert content_part((1 << 32) + 3) == "test_final"
    assert content_part((2 << 32) + 3) == "train" and content_part(((CARVE + 1) << 32) + 5) == "test_final"
    assert content_part(8 + (1 << 32)) == "test"  # the test bucket wins whatever the high half says
    # a pretraining task set is not carved: train keeps every key that is not a test's, as before val existed
    assert content_part(1, carved=False) == content_part((1 << 32) + 3, carved=False) == "train"
    assert content_part(0, carved=False) == "test"


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


# sha256 of the first 60 tasks' JSON of each split at the evaluation's seed, computed by main's code before the
# partition gained val and test_final: test_id, test_ood and pretrain_test are the tasks every earlier figure was
# measured on.
BEFORE = {
    ("toolworld", "test_id"): "e838e2461d10aa6855f2d84e2a19c004a0ca6dc91ce50b234cbbfa84cd7cad0b",
    ("toolworld", "test_ood"): "4ea84153c2be54e6c9f96f7a30f36559bc72978bc53253b7edad44a47d93fdad",
    ("toolworld", "pretrain_test"): "5e9b82627c7acb0a14fab9ccd5e4ea9e8fd25d9c886c3b45eeb298fd67d18780",
    ("codegen", "test_id"): "5181fca1b3df55c7e46e853c71ba1d79bd6b55980352281b1286d3805e193487",
    ("codegen", "test_ood"): "263d79aa37a917f280f8707be22a2fb290b69056f588f49a69ccdeebc4dc636f",
    ("codegen", "pretrain_test"): "5dadf43a4f7fb69da98549dbacdcfea8b749f08b0abac7806345a486a80c1f82",
}


def _digest(items) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


@pytest.mark.parametrize(("env", "split"), list(BEFORE))
def test_the_test_splits_are_the_tasks_they_were(env, split):
    worlds = WorldSplit.from_config(Params().envs).for_split(split)
    tasks = make_tasks(env, split, 60, 1_000_003, worlds)
    assert _digest(t.to_json() for t in tasks) == BEFORE[(env, split)]


# sha256 of the pretraining stream's train tasks as main's code draws them (the shipped base's warm-start data and
# the cold start's oracle tasks, default params): the toolworld demonstrations' first 300 tasks (seed 0) and their
# experience pool's 200 (seed 7919); codegen's at seed 1 (120) and 7920 (200); the cold start's first 200 at seed
# 202 with the default mix and with toolworld + codegen; and the texts of build_demos(n=80) at the warm start's
# settings.
MAIN_PRETRAINING = {
    "toolworld_demo_tasks": "0c48b94b5b2c1fd76a2f140d06148906472f59a7ab914356fabbbf81eadf310e",
    "toolworld_pool": "2787bffa6e3ad364c5362ac3e89f73d627f9a915a0acd76a78c4d00c4e8be2b0",
    "codegen_demo_tasks": "6ea0cde1e8af6e8033fa6a8ab709bf5fc8b1cee71db517bac4e9396b7488064c",
    "codegen_pool": "ba19d27c58abceec52d059355c2c03996f2aac1c4d6a63bfcd6398305eadf4b4",
    "coldstart_default_mix": "e7b1f8d47e07bf6fd44204c5296e462dae65020029cce6cdc8a2e6f4e6e41ff4",
    "coldstart_with_codegen": "92a1a31fc6344684f75e0d973994d1632c62a41290cd9292f5d65a3cd631895b",
    "toolworld_demo_texts": "e07021fbdd3d1c7464bcb704c96df0b9b13a9d28e31c3d032b693ee2b477ea76",
}


def test_the_pretraining_streams_train_tasks_are_mains():
    """The warm start's and the cold start's train tasks are drawn exactly as before val and test_final (same
    instances, same order): the shipped base rests on them and `lopd base` must still rebuild it."""
    params = Params()
    pretrain = WorldSplit.from_config(params.envs).pretrain
    ws = params.model.warmstart
    demos, pool = demo_tasks(300, params.seed, pretrain)
    code, code_pool = codegen_demo_tasks(120, params.seed + 1, pretrain)
    with_codegen = replace(params.envs, mix={"toolworld": 1.0, "codegen": 1.0})
    seed = params.seed + COLDSTART_SEED_OFFSET
    texts = build_demos(
        n=80,
        experience_fraction=ws.experience_fraction,
        max_experiences=ws.max_experiences,
        convention_noise=ws.convention_noise,
        slip=ws.slip,
        seed=params.seed,
        worlds=pretrain,
    )
    got = {
        "toolworld_demo_tasks": demos,
        "toolworld_pool": pool,
        "codegen_demo_tasks": code,
        "codegen_pool": code_pool,
        "coldstart_default_mix": pretraining_tasks(params.envs, 200, seed),
        "coldstart_with_codegen": pretraining_tasks(with_codegen, 200, seed),
    }
    digests = {name: _digest(t.to_json() for t in tasks) for name, tasks in got.items()}
    digests["toolworld_demo_texts"] = _digest(d.text() for d in texts)
    assert digests == MAIN_PRETRAINING
    # not carved: train in the pretraining worlds keeps content a deployment set gives to val and test_final
    parts = {content_part(toolworld_key(t)) for t in demos} | {content_part(codegen_key(t)) for t in code}
    assert {"val", "test_final"} <= parts


@pytest.mark.parametrize("env", ["toolworld", "codegen"])
@pytest.mark.parametrize("split", ["val", "test_final"])
def test_val_and_test_final_are_refused_in_the_pretraining_worlds(env, split):
    pretrain = WorldSplit.from_config(Params().envs).pretrain
    with pytest.raises(ValueError, match="drawn in the deployment worlds only"):
        make_tasks(env, split, 1, 0, pretrain)

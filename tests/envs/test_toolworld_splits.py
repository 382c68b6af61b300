"""Task generation: deterministic per seed, different across seeds, disjoint splits, even cycling."""

from __future__ import annotations

import collections
import json
import time

import pytest
from _toolworld_fixtures import N_OOD, N_TRAIN

from lopd_core.envs import TEMPLATES, WORLDS, Task, make_tasks


def _content(t: Task):
    return (t.template, t.world, t.instruction, json.dumps(t.spec, sort_keys=True))


def test_deterministic_per_seed_and_prefix_stable():
    a = make_tasks("toolworld", "train", 150, seed=11)
    b = make_tasks("toolworld", "train", 150, seed=11)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert [t.to_json() for t in make_tasks("toolworld", "train", 60, seed=11)] == [t.to_json() for t in a[:60]]


def test_different_across_seeds():
    a = make_tasks("toolworld", "train", 100, seed=1)
    b = make_tasks("toolworld", "train", 100, seed=2)
    assert sum(_content(x) == _content(y) for x, y in zip(a, b)) == 0


def test_splits_disjoint_and_use_the_right_templates():
    train = make_tasks("toolworld", "train", 600, seed=0)
    test_id = make_tasks("toolworld", "test_id", 300, seed=0)
    test_id_other_seed = make_tasks("toolworld", "test_id", 300, seed=5)
    ood = make_tasks("toolworld", "test_ood", 80, seed=0)
    train_keys = {_content(t) for t in train} | {_content(t) for t in make_tasks("toolworld", "train", 600, seed=5)}
    assert not train_keys & {_content(t) for t in test_id + test_id_other_seed}
    assert (
        {t.template for t in train}
        == {t.template for t in test_id}
        == {n for n, t in TEMPLATES.items() if t.split_group == "train"}
    )
    assert {t.template for t in ood} == {n for n, t in TEMPLATES.items() if t.split_group == "ood"}
    assert {t.split for t in test_id} == {"test_id"} and {t.split for t in ood} == {"test_ood"}
    ids = [t.task_id for t in train + test_id + ood]
    assert len(ids) == len(set(ids))
    assert len({_content(t) for t in train}) == len(train)  # no duplicates inside a split either


def test_templates_and_worlds_cycle_evenly():
    n = N_TRAIN * len(WORLDS) * 2
    tasks = make_tasks("toolworld", "train", n, seed=3)
    per_template = collections.Counter(t.template for t in tasks)
    per_pair = collections.Counter((t.template, t.world) for t in tasks)
    assert set(per_template.values()) == {len(WORLDS) * 2}
    assert set(per_pair.values()) == {2}
    ood = make_tasks("toolworld", "test_ood", N_OOD * len(WORLDS), seed=3)
    assert set(collections.Counter((t.template, t.world) for t in ood).values()) == {1}


def test_task_fields_and_round_trip():
    for t in make_tasks("toolworld", "test_ood", 16, seed=0) + make_tasks("toolworld", "train", 16, seed=0):
        assert Task.from_json(t.to_json()) == t
        assert t.task_id == f"toolworld/{t.split}/{t.template}/{int(t.task_id.rsplit('/', 1)[1]):06d}"
        assert t.env == "toolworld" and t.world in WORLDS and t.instruction.startswith(f"[{t.world}] ")
        assert set(t.spec) >= {"domains", "state", "conventions", "checks", "params", "answer"}
        assert t.spec["domains"] == list(TEMPLATES[t.template].domains)


def test_generation_is_fast():
    start = time.perf_counter()
    make_tasks("toolworld", "train", 1000, seed=9)
    assert time.perf_counter() - start < 3.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_tasks("nope", "train", 1, 0)
    with pytest.raises(ValueError):
        make_tasks("toolworld", "validation", 1, 0)

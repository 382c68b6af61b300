"""Worlds of the adaptation setting: generated pretraining worlds, held-out deployment worlds, and the splits
and demonstrations drawn from each (lopd_core/envs/toolworld/worlds.py and tasks.py, model/demos.py)."""

from __future__ import annotations

import collections

import pytest

from lopd_core.config import NAMED_WORLDS, Params
from lopd_core.envs import KNOBS, WORLDS, make_tasks
from lopd_core.envs.mix import deployment_tasks, pretraining_tasks
from lopd_core.envs.toolworld.worlds import WorldSplit, _combination, deploy_worlds, pretrain_worlds
from lopd_core.model.demos import build_demos


def test_pretraining_worlds_are_deterministic_prefix_stable_and_seeded():
    a, b = pretrain_worlds(64, seed=0), pretrain_worlds(64, seed=0)
    assert a == b and list(a) == list(b)
    longer = pretrain_worlds(80, seed=0)
    assert list(longer)[:64] == list(a) and all(longer[w] == a[w] for w in a)
    other = pretrain_worlds(64, seed=1)
    assert list(other) != list(a)


def test_pretraining_worlds_are_valid_distinct_and_never_a_named_world():
    worlds = pretrain_worlds(200, seed=3)
    assert len(worlds) == 200 and not set(worlds) & set(WORLDS)
    combos = {_combination(c) for c in worlds.values()}
    assert len(combos) == 200  # no two generated worlds share the full combination
    assert not combos & {_combination(c) for c in WORLDS.values()}  # a deployment world is new as a whole
    for conv in worlds.values():
        assert set(conv) == set(KNOBS)
        for dom, knobs in conv.items():
            assert set(knobs) == set(KNOBS[dom]) and all(v in KNOBS[dom][k] for k, v in knobs.items())
    # the draw covers the knob space: every value of every knob occurs
    for dom, knobs in KNOBS.items():
        for knob, values in knobs.items():
            assert {c[dom][knob] for c in worlds.values()} == set(values)


def test_config_names_the_named_worlds_as_plain_data():
    assert tuple(WORLDS) == NAMED_WORLDS
    with pytest.raises(KeyError):
        deploy_worlds(["atlantis"])


def test_deployment_and_pretraining_streams_never_mix_worlds():
    envs = Params().envs
    split = WorldSplit.from_config(envs)
    assert set(envs.deploy_worlds) == set(split.deploy) and len(split.pretrain) == envs.pretrain_worlds
    for name in ("train", "test_id", "test_ood"):
        tasks = deployment_tasks(envs, name, 40, seed=5)
        assert {t.world for t in tasks} == set(envs.deploy_worlds)
        assert all(t.spec["conventions"] == {d: WORLDS[t.world][d] for d in t.spec["domains"]} for t in tasks)
    held_out = deployment_tasks(envs, "pretrain_test", 128, seed=5)
    assert {t.world for t in held_out} == set(split.pretrain)  # world-major: 128 tasks visit all 64 twice
    train = pretraining_tasks(envs, 400, seed=5)
    assert {t.world for t in train} <= set(split.pretrain)

    def content(t):
        return (t.world, t.template, t.instruction, str(t.spec))

    assert not {content(t) for t in train} & {content(t) for t in held_out}


def test_world_major_order_spreads_any_prefix_over_the_worlds():
    worlds = pretrain_worlds(16, seed=0)
    tasks = make_tasks("toolworld", "train", 16 * 3, seed=0, worlds=worlds)
    assert set(collections.Counter(t.world for t in tasks).values()) == {3}
    assert [t.world for t in tasks[:16]] == list(worlds)


def test_warm_start_never_plays_a_deployment_world_and_names_them_only_as_aliases():
    worlds = pretrain_worlds(8, seed=0)
    demos = build_demos(
        n=400, experience_fraction=0.7, max_experiences=3, convention_noise=0.15, slip=0.0, seed=0, worlds=worlds
    )
    assert {d.world_followed for d in demos} <= set(worlds)
    named = [d for d in demos if any(f"[{w}]" in d.user for w in WORLDS)]
    assert named, "the deployment candidates' names must be trained tokens"
    assert all(d.experiences for d in named)  # only ever beside experiences that show another world's rules
    for d in named:
        alias = d.user[1 : d.user.index("]")]
        assert alias in WORLDS and d.world_followed in worlds
        assert all(e.startswith(f"[{alias}]") or f"[{alias}]" in e for e in d.experiences)


def test_any_prefix_covers_worlds_and_templates_and_every_pair_comes_in_turn():
    from lopd_core.envs.toolworld.tasks import _templates_for

    worlds = pretrain_worlds(64, seed=0)
    n_templates = len(_templates_for("train"))
    tasks = make_tasks("toolworld", "train", 64 * n_templates, seed=0, worlds=worlds)
    prefix = tasks[:200]
    assert len({t.template for t in prefix}) == n_templates and len({t.world for t in prefix}) == 64
    assert len({(t.world, t.template) for t in tasks}) == 64 * n_templates  # each pair exactly once

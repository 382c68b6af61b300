"""Size and shape of toolworld: templates, domains, tools, worlds, conventions, instructions."""

from __future__ import annotations

import re

from _toolworld_fixtures import all_tasks

from lopd_core.envs import DOMAINS, KNOBS, TEMPLATES, WORLDS, make_env, run_oracle, tool_schemas
from lopd_core.envs.toolworld.env import system_prompt


def test_at_least_40_templates_with_train_and_ood_groups():
    groups = [t.split_group for t in TEMPLATES.values()]
    assert len(TEMPLATES) >= 40
    assert groups.count("train") >= 32 and groups.count("ood") >= 8
    assert sum(len(t.domains) > 1 for t in TEMPLATES.values()) >= 8
    assert set().union(*(t.domains for t in TEMPLATES.values())) == set(DOMAINS)


def test_six_domains_with_four_tools_each_named_by_domain():
    assert len(DOMAINS) >= 6
    for name in DOMAINS:
        schemas = tool_schemas(name)
        assert len(schemas) >= 4, name
        assert all(s["name"].startswith(name + "_") for s in schemas)
        assert all(s["description"] for s in schemas)


def test_worlds_and_conventions():
    assert len(WORLDS) == 4
    for domain, knobs in KNOBS.items():
        assert len(knobs) >= 2, domain
        combos = {tuple(WORLDS[w][domain][k] for k in knobs) for w in WORLDS}
        assert len(combos) == len(WORLDS), domain  # every pair of worlds differs in every domain
        for knob in knobs:
            assert len({WORLDS[w][domain][knob] for w in WORLDS}) >= 2, (domain, knob)


def test_instructions_are_short_and_never_reveal_conventions():
    hints = re.compile(
        r"\b(wire|transfer|cents?|verify|confirm|cart|checkout|lock|unlock|trash|delete|sms|e-?mail"
        r"|iata|hold|dd/mm|mm/dd|yyyy|iso)\b",
        re.IGNORECASE,
    )
    for task in all_tasks():
        body = task.instruction.split("] ", 1)[1]
        assert len(body.split()) <= 25, task.instruction
        assert not hints.search(body), task.instruction
        assert not any(f"{d}_" in body for d in DOMAINS), task.instruction


def test_observations_and_prompts_are_compact():
    for task in all_tasks()[::5]:
        assert len(system_prompt(task.spec["domains"])) < 500
        _, results, _ = run_oracle(task)
        for r in results[:-1]:
            assert len(r.observation) <= 240, r.observation
        env = make_env(task)
        assert env.reset(task).user == task.instruction

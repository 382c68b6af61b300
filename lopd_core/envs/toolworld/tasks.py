"""toolworld task sets: train / test_id from the train templates, test_ood from the ood ones.

Instance ``i`` of a split depends only on (seed, split, i), so a larger ``n`` extends a
smaller one. Worlds and templates cycle together, and every (world, template) pair comes in turn. train, val,
test_id and test_final draw from disjoint rng streams *and* are disjoint by content: every instance's
content hash assigns it to exactly one of them (``held_out.py``: 1 in 8 to test_id, and of the rest, in a named
world, 1 in 32 to val and 1 in 32 to test_final), so no held-out task can equal a train task, or another held-out
split's, for any seed or size. In a pretraining world nothing is carved: its train tasks (the warm start's) are
the ones they always were, and val / test_final are refused there. Each task's ``max_turns`` is the number of
calls its oracle needs + 2 (one for the answer, one spare); generation replays the oracle
and fails loudly if a template ever produces an instance its oracle cannot solve.

Which worlds a split draws from is the caller's choice (``worlds``: name -> conventions, default the four
named worlds): the pipeline passes the deployment worlds for train / test_id / test_ood and the pretraining
worlds for the warm start's train tasks and for ``pretrain_test`` (test_id-style held-out instances of them); val
and test_final are drawn in the deployment worlds, like test_id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random

from ..base import SPLITS, Task
from ..held_out import CARVED_SPLITS, MAX_ATTEMPTS, is_deployment_world, refuse_pretraining, takes
from .templates import TEMPLATES, Template
from .worlds import WORLDS, conventions_for

ENV_NAME = "toolworld"


def _content_key(tpl: Template, world: str, draft) -> int:
    return _key(tpl.name, world, draft.instruction, draft.state, draft.checks, draft.answer)


def _key(template: str, world: str, instruction: str, state, checks, answer) -> int:
    blob = json.dumps([template, world, instruction, state, checks, answer], sort_keys=True)
    return int.from_bytes(hashlib.sha1(blob.encode()).digest()[:8], "big")


def task_content_key(task: Task) -> int:
    """The content key (held_out.py) of a built task: the same hash its draft was assigned a split by."""
    instruction = task.instruction.removeprefix(f"[{task.world}] ")
    spec = task.spec
    return _key(task.template, task.world, instruction, spec["state"], spec["checks"], spec["answer"])


def _templates_for(split: str) -> list[Template]:
    group = "ood" if split == "test_ood" else "train"
    return [t for t in TEMPLATES.values() if t.split_group == group]


def build_task(tpl: Template, world: str, split: str, index: int, draft, worlds=None) -> Task:
    spec = {
        "domains": list(tpl.domains),
        "state": draft.state,
        "conventions": conventions_for(world, tpl.domains, worlds),
        "checks": draft.checks,
        "params": draft.params,
        "answer": draft.answer,
    }
    task = Task(
        task_id=f"{ENV_NAME}/{split}/{tpl.name}/{index:06d}",
        env=ENV_NAME,
        split=split,
        template=tpl.name,
        world=world,
        instruction=f"[{world}] {draft.instruction}",
        spec=json.loads(json.dumps(spec)),
        max_turns=64,
    )
    from .oracle import run_oracle  # local: oracle imports the env, which is fine but keep splits light

    actions, results, _ = run_oracle(task)
    if not results[-1].info["success"]:
        raise RuntimeError(f"template {tpl.name} produced an instance its oracle cannot solve: {task.to_json()}")
    return dataclasses.replace(task, max_turns=len(actions) - 1 + 2)


def make_toolworld_tasks(split: str, n: int, seed: int, worlds: dict[str, dict] | None = None) -> list[Task]:
    """``n`` toolworld tasks of ``split``, cycling over ``worlds`` (name -> conventions; default the named
    worlds)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    templates = _templates_for(split)
    table = WORLDS if worlds is None else worlds
    names = list(table)
    if not names:
        raise ValueError(f"no worlds to draw {split} tasks from")
    if split in CARVED_SPLITS and not all(is_deployment_world(w) for w in names):
        refuse_pretraining(split, ENV_NAME)
    period = math.lcm(len(names), len(templates))
    tasks = []
    for i in range(n):
        # Worlds and templates both cycle fastest, so any prefix of a stream spreads evenly over many
        # pretraining worlds *and* all templates; the shift after each lcm(worlds, templates) tasks moves every
        # world on to the templates it has not met, so lcm * gcd tasks visit every (world, template) once.
        world = names[i % len(names)]
        tpl = templates[(i + i // period) % len(templates)]
        for attempt in range(MAX_ATTEMPTS):
            rng = random.Random(f"{ENV_NAME}|{seed}|{split}|{i}|{attempt}")
            draft = tpl.generate(rng, world, table)
            if split == "test_ood" or takes(split, _content_key(tpl, world, draft), is_deployment_world(world)):
                break
        else:
            raise RuntimeError(f"could not draw a {split} instance of {tpl.name}")
        tasks.append(build_task(tpl, world, split, i, draft, table))
    return tasks

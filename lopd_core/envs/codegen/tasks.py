"""Deterministic codegen task sets: `train` / `test_id` from the train families, `test_ood` from held-out ones.

Instance `i` of a split depends only on (seed, split, i), so a larger `n` extends a smaller one. Families
cycle evenly and, within a family, difficulty levels 1..3 cycle. As in toolworld, train, val, test_id and
test_final (val and test_final from the train families too) are disjoint by content: an instance's content hash
sends it to exactly one of them (lopd_core/envs/held_out.py). val and test_final are carved out of train only in a
deployment task set; drawn for the pretraining worlds (the warm start, the cold start) train is what it always was.
Expected outputs come from calling the family's reference function here (our code, never model output); every
value passes through JSON, the form in which the sandbox reports results.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random

from lopd_core.envs.base import SPLITS, Task
from lopd_core.envs.held_out import MAX_ATTEMPTS, is_deployment_set, refuse_pretraining, takes

from .families_lists import FAMILIES as LIST_FAMILIES
from .families_numbers import FAMILIES as NUMBER_FAMILIES
from .families_text import FAMILIES as TEXT_FAMILIES
from .family import LEVELS, Family

ENV_NAME = "codegen"
FAMILIES: dict[str, Family] = {f.name: f for f in NUMBER_FAMILIES + TEXT_FAMILIES + LIST_FAMILIES}
DEFAULT_ATTEMPTS = 3  # T: attempts per task (the first one and two after feedback)


def tests_per_level(level: int) -> int:
    return 3 + 2 * level


def families_for(split: str) -> list[Family]:
    group = "ood" if split == "test_ood" else "train"
    return [f for f in FAMILIES.values() if f.group == group]


def _draw_tests(family: Family, level: int, rng: random.Random) -> list[dict]:
    inputs = [list(args) for args in family.edge_cases[: level - 1]]
    seen = {json.dumps(a) for a in inputs}
    for _ in range(50 * tests_per_level(level)):
        if len(inputs) >= tests_per_level(level):
            break
        args = json.loads(json.dumps(family.gen_args(rng, level)))
        if json.dumps(args) not in seen:
            seen.add(json.dumps(args))
            inputs.append(args)
    rng.shuffle(inputs)
    return [
        {"args": args, "expected": json.loads(json.dumps(family.reference(*copy.deepcopy(args))))} for args in inputs
    ]


def _instruction(family: Family, tests: list[dict]) -> str:
    example = tests[0]
    from .grading import call_text, shown

    return (
        f"Write a Python function {family.signature.removeprefix('def ')}. {family.statement} "
        f"Example: {call_text(family.function, example['args'])} == {shown(example['expected'])}"
    )


def _content_key(family: Family, level: int, tests: list[dict]) -> int:
    return _key(family.name, level, tests)


def _key(family: str, level: int, tests: list[dict]) -> int:
    blob = json.dumps([family, level, tests], sort_keys=True)
    return int.from_bytes(hashlib.sha1(blob.encode()).digest()[:8], "big")


def task_content_key(task: Task) -> int:
    """The content key (lopd_core/envs/held_out.py) of a built task: the hash its split was assigned by."""
    return _key(task.template, task.spec["level"], task.spec["tests"])


def build_task(
    family: Family, level: int, split: str, index: int, tests: list[dict], attempts: int = DEFAULT_ATTEMPTS
) -> Task:
    spec = {
        "function": family.function,
        "tests": tests,
        "reference": family.source,
        "level": level,
        "topic": family.topic,
    }
    return Task(
        task_id=f"{ENV_NAME}/{split}/{family.name}/{index:06d}",
        env=ENV_NAME,
        split=split,
        template=family.name,
        world=f"level{level}",
        instruction=_instruction(family, tests),
        spec=json.loads(json.dumps(spec)),
        max_turns=attempts,
    )


def make_codegen_tasks(split: str, n: int, seed: int, attempts: int = DEFAULT_ATTEMPTS, *, worlds=None) -> list[Task]:
    """`n` tasks of `split`. `worlds`: the worlds of the stream they are drawn for (codegen has none of its own):
    the pretraining worlds' train tasks are not carved, the deployment sets' are (held_out.py says why)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    carved = is_deployment_set(worlds)
    if not carved:
        refuse_pretraining(split, ENV_NAME)
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    families = families_for(split)
    tasks = []
    for i in range(n):
        family = families[i % len(families)]
        level = LEVELS[(i // len(families)) % len(LEVELS)]
        for attempt in range(MAX_ATTEMPTS):
            rng = random.Random(f"{ENV_NAME}|{seed}|{split}|{i}|{attempt}")
            tests = _draw_tests(family, level, rng)
            if split == "test_ood" or takes(split, _content_key(family, level, tests), carved):
                break
        else:
            raise RuntimeError(f"could not draw a {split} instance of {family.name}")
        tasks.append(build_task(family, level, split, i, tests, attempts))
    return tasks

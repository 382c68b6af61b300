"""Warm-start demonstrations and in-context experience for the codegen environment.

The codegen counterpart of demos.py (toolworld), with the same two kinds of demonstration:

* **Without experience** (the policy's own prior). The answer is the family's reference solution, but with
  probability `noise` the first attempt is a *flawed variant* of it — one operator, comparison, builtin or
  constant changed (`flawed_variant`) — which the sandbox really runs; its feedback (the first failing test)
  is the observation, and the next attempt is the reference. Each later attempt may be flawed again with
  probability `slip`, so some demonstrations end unsolved. The base therefore knows the families imperfectly
  and sees how feedback leads to a fix — room to improve, not zero.
* **With experience** (in-context learning). The first user turn carries 1..max_experiences successes of the
  same family (other instances; the same topic where the family has too few) and the answer is the function
  they show. Unlike toolworld there is nothing to rename: a family's solution is the same code in every
  instance, so what these teach is to copy and adapt a function read in context — what the latent teacher
  relies on.

Clean answers are built without running the reference (every family's reference passes all its tests at
every level: tests/envs/test_codegen_env.py), which saves a sandbox run per demonstration; flawed attempts always
run in the sandbox, because their feedback must be the real one. Model output never reaches this module.
"""

from __future__ import annotations

import dataclasses
import random
import re
from concurrent.futures import ThreadPoolExecutor

from lopd_core.envs import Task, make_tasks
from lopd_core.envs.codegen import CODEGEN_LIMITS, FAMILIES, SYSTEM_PROMPT, CodegenEnv, oracle_action
from lopd_core.experience import format_code_experience
from lopd_core.model.demos import Demo

# Flawed attempts only need their first failing test: short limits keep a variant that loops forever cheap.
DEMO_LIMITS = dataclasses.replace(CODEGEN_LIMITS, timeout_s=0.5, cpu_s=0.5)
PLAY_WORKERS = 2

# (pattern, replacement) pairs a flawed variant picks one occurrence of: the slips a programmer makes.
_MUTATIONS = [
    (re.compile(p), r)
    for p, r in (
        (r" < ", " <= "),
        (r" <= ", " < "),
        (r" > ", " >= "),
        (r" >= ", " > "),
        (r" == ", " != "),
        (r" != ", " == "),
        (r" \+ ", " - "),
        (r" - ", " + "),
        (r" \* ", " + "),
        (r" // ", " / "),
        (r" % ", " // "),
        (r"\band\b", "or"),
        (r"\bor\b", "and"),
        (r"\bmin\(", "max("),
        (r"\bmax\(", "min("),
        (r"\bTrue\b", "False"),
        (r"\bFalse\b", "True"),
        (r"\[-1\]", "[0]"),
        (r"\b0\b", "1"),
        (r"\b1\b", "0"),
        (r"\.lower\(\)", ".upper()"),
        (r"\.upper\(\)", ".lower()"),
        (r"\breversed\(", "list("),
    )
]


def flawed_variant(source: str, rng: random.Random) -> str | None:
    """`source` with one slip in its body (never in the `def` line), or None when no slip applies."""
    head, _, body = source.partition("\n")
    sites = [(m.start(), m.end(), repl) for pattern, repl in _MUTATIONS for m in pattern.finditer(body)]
    if not sites:
        return None
    start, end, repl = rng.choice(sites)
    return f"{head}\n{body[:start]}{repl}{body[end:]}"


def oracle_episode(task: Task) -> list[dict]:
    """The episode record of the reference answered on the first attempt (it passes every test)."""
    n = len(task.spec["tests"])
    return [{"action": oracle_action(task), "call": None, "observation": f"passed {n}/{n} tests", "error": None}]


def play_codegen(
    task: Task, *, noise: float = 0.0, slip: float = 0.0, rng: random.Random | None = None, limits=CODEGEN_LIMITS
) -> tuple[Demo, bool, list[dict]]:
    """Play `task` through a fresh environment (every attempt runs in the sandbox): the first attempt is
    flawed with probability `noise`, each later one with probability `slip`, a clean one is the reference.
    Returns the demonstration, whether it succeeded, and the episode record (as demos.play does)."""
    rng = rng or random.Random(0)
    reference = oracle_action(task)
    env = CodegenEnv(limits)
    env.reset(task)
    actions, observations, result = [], [], None
    for attempt in range(task.max_turns):
        flawed = rng.random() < (noise if attempt == 0 else slip)
        action = (flawed_variant(reference, rng) if flawed else None) or reference
        result = env.step(action)
        actions.append(action)
        if result.done:
            break
        observations.append(result.observation)
    demo = Demo(SYSTEM_PROMPT, task.instruction, (), tuple(actions), tuple(observations), task.world)
    return demo, bool(result.info.get("success", False)), env.episode


class CodegenExperiencePool:
    """Reference successes on training tasks, indexed by family and by topic (the codegen ExperiencePool)."""

    def __init__(self, tasks: list[Task]):
        self.by_family: dict[str, list[tuple[str, str]]] = {}
        self.by_topic: dict[str, list[tuple[str, str]]] = {}
        for task in tasks:
            entry = (task.task_id, format_code_experience(task.instruction, oracle_episode(task)))
            self.by_family.setdefault(task.template, []).append(entry)
            self.by_topic.setdefault(FAMILIES[task.template].topic, []).append(entry)

    def sample(self, task: Task, k: int, rng: random.Random) -> list[str]:
        """Up to k successes: same family first, then the same topic (held-out families have only these);
        never the task itself."""
        same = [e for e in self.by_family.get(task.template, []) if e[0] != task.task_id]
        picked = rng.sample(same, min(k, len(same)))
        if len(picked) < k:
            seen = {e[0] for e in picked} | {task.task_id}
            near = [e for e in self.by_topic.get(FAMILIES[task.template].topic, []) if e[0] not in seen]
            picked += rng.sample(near, min(k - len(picked), len(near)))
        return [text for _, text in picked]


def codegen_demo_tasks(n: int, seed: int, worlds: dict[str, dict]) -> tuple[list[Task], list[Task]]:
    """The training tasks `build_codegen_demos` plays and those its experiences come from. `worlds`: the
    pretraining worlds, whose codegen train tasks are not carved (lopd_core/envs/held_out.py), so the warm start's
    stay what they were; apart so a test can pin them (tests/envs/test_held_out.py)."""
    pool = make_tasks("codegen", "train", max(200, n // 4), seed + 7919, worlds)
    return make_tasks("codegen", "train", n, seed, worlds), pool


def build_codegen_demos(
    *,
    n: int,
    experience_fraction: float,
    max_experiences: int,
    noise: float,
    slip: float,
    seed: int,
    worlds: dict[str, dict],
) -> list[Demo]:
    """`n` codegen demonstrations from the train split of the stream of `worlds` (the warm start's: the pretraining
    worlds), a fraction with same-family experience in context."""
    rng = random.Random(seed)
    tasks, pool_tasks = codegen_demo_tasks(n, seed, worlds)
    pool = CodegenExperiencePool(pool_tasks)
    demos: list[Demo | None] = []
    noisy: list[tuple[int, Task, int]] = []  # (position, task, its own seed): played below, in parallel
    for task in tasks:
        if rng.random() < experience_fraction:
            experiences = pool.sample(task, rng.randint(1, max_experiences), rng)
            if experiences:
                demos.append(
                    Demo(SYSTEM_PROMPT, task.instruction, tuple(experiences), (oracle_action(task),), (), task.world)
                )
                continue
        if rng.random() < noise:
            noisy.append((len(demos), task, rng.randrange(1 << 30)))
            demos.append(None)
        else:
            demos.append(Demo(SYSTEM_PROMPT, task.instruction, (), (oracle_action(task),), (), task.world))

    def play(item):  # each play has its own rng, so the result does not depend on thread scheduling
        _, task, own_seed = item
        return play_codegen(task, noise=1.0, slip=slip, rng=random.Random(own_seed), limits=DEMO_LIMITS)[0]

    with ThreadPoolExecutor(max_workers=PLAY_WORKERS) as executor:  # the work is in the sandbox children
        for (position, _, _), demo in zip(noisy, executor.map(play, noisy)):
            demos[position] = demo
    return demos

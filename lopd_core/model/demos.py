"""Warm-start demonstrations: oracle episodes with controlled noise, some with experience in context.

Two kinds of demonstration, mirroring how a pretrained LLM meets a new tool world:

* **Without experience** (the policy's own prior). The oracle plays the task, but with probability
  `convention_noise` it follows *another* world's conventions, and each call slips with probability `slip`.
  The base therefore knows each world's rules only imperfectly — room to improve, not zero.
* **With experience** (in-context learning). The first user turn carries 1..max_experiences oracle successes
  from the same world (sharing the task's template where possible) and the demonstration follows the rules
  those successes show. The world's name is replaced by a fresh synthetic one in the instruction and in the
  experiences, so these demonstrations teach *reading rules from experience* and leak nothing about which
  world has which rules; the base's knowledge of the pretraining worlds stays the noisy prior above.

Only pretraining worlds are played (`worlds`). The deployment candidates' names (the named worlds) appear only
as such aliases, over other worlds' conventions: the names are trained tokens, but carry no convention of
their own, so a deployment world is new to the base.

A demonstration is plain text (system, user, experiences, the action and observation turns); `encode_demo`
turns it into ids with the chat codec, the policy's actions marked for the loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lopd_core.envs import TEMPLATES, WORLDS, Task, make_tasks, run_oracle
from lopd_core.envs.toolworld.worlds import conventions_for
from lopd_core.experience import format_experience
from lopd_core.model.chat import IM_END, ChatCodec, TrajectoryIds, first_turn_text, observation_text


@dataclass(frozen=True)
class Demo:
    system: str
    user: str
    experiences: tuple[str, ...]
    actions: tuple[str, ...]
    observations: tuple[str, ...]  # observation after each action but the last
    world_followed: str  # whose conventions the actions follow

    def text(self) -> str:
        parts = [first_turn_text(self.system, self.user, list(self.experiences) or None)]
        for i, action in enumerate(self.actions):
            parts.append(action + IM_END)
            if i < len(self.observations):
                parts.append(observation_text(self.observations[i]))
        return "".join(parts)


def play(
    task: Task,
    *,
    conventions_world: str | None = None,
    slip: float = 0.0,
    rng: random.Random | None = None,
    worlds: dict | None = None,
) -> tuple[Demo, bool, list[dict]]:
    """Run the oracle on `task` (optionally under another world's conventions, looked up in `worlds`); return
    the demo, whether it succeeded, and the episode record."""
    conventions = conventions_for(conventions_world, worlds=worlds) if conventions_world else None
    actions, results, env = run_oracle(task, conventions=conventions, slip=slip, rng=rng)
    observations = tuple(r.observation for r in results[:-1])
    first_system = env_system(task)
    success = bool(results[-1].info.get("success", False))
    demo = Demo(first_system, task.instruction, (), tuple(actions), observations, conventions_world or task.world)
    return demo, success, env.episode


def env_system(task: Task) -> str:
    from lopd_core.envs import make_env

    return make_env(task).reset(task).system


class ExperiencePool:
    """Oracle successes on training tasks, indexed by (world, template) and (world, domain)."""

    def __init__(self, tasks: list[Task]):
        self.by_template: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self.by_domain: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for task in tasks:
            _, success, episode = play(task)
            if not success:
                continue
            entry = (task.task_id, format_experience(task.instruction, episode))
            self.by_template.setdefault((task.world, task.template), []).append(entry)
            for domain in TEMPLATES[task.template].domains:
                self.by_domain.setdefault((task.world, domain), []).append(entry)

    def sample(self, task: Task, k: int, rng: random.Random) -> list[str]:
        """Up to k successes of the same world: same template first, then a shared domain; never the task."""
        same = [e for e in self.by_template.get((task.world, task.template), []) if e[0] != task.task_id]
        picked = rng.sample(same, min(k, len(same)))
        if len(picked) < k:
            seen = {e[0] for e in picked} | {task.task_id}
            near = [
                e
                for d in TEMPLATES[task.template].domains
                for e in self.by_domain.get((task.world, d), [])
                if e[0] not in seen
            ]
            picked += rng.sample(near, min(k - len(picked), len(near)))
        return [text for _, text in picked]


def _rename_world(text: str, world: str, alias: str) -> str:
    return text.replace(f"[{world}]", f"[{alias}]")


def _alias(rng: random.Random, named_share: float) -> str:
    if rng.random() < named_share:
        return rng.choice(sorted(WORLDS))
    return f"w{rng.randint(10, 99)}"


def demo_tasks(n: int, seed: int, worlds: dict[str, dict] | None) -> tuple[list[Task], list[Task]]:
    """The training tasks `build_demos` plays and those its experiences come from. Apart so a test can pin them:
    in the pretraining worlds they are the shipped base's warm-start data (tests/envs/test_held_out.py)."""
    pool = make_tasks("toolworld", "train", max(200, n // 4), seed + 7919, worlds)
    return make_tasks("toolworld", "train", n, seed, worlds), pool


def build_demos(
    *,
    n: int,
    experience_fraction: float,
    max_experiences: int,
    convention_noise: float,
    slip: float,
    seed: int,
    worlds: dict[str, dict] | None = None,
    named_alias_share: float = 0.25,
) -> list[Demo]:
    """`n` demonstrations on training tasks of `worlds` (name -> conventions; default the named worlds).
    A share `named_alias_share` of the experience demonstrations rename their world to a named world."""
    rng = random.Random(seed)
    names = sorted(WORLDS if worlds is None else worlds)
    tasks, pool_tasks = demo_tasks(n, seed, worlds)
    pool = ExperiencePool(pool_tasks)
    demos = []
    for task in tasks:
        if rng.random() < experience_fraction:
            experiences = pool.sample(task, rng.randint(1, max_experiences), rng)
            if experiences:
                demo, _, _ = play(task, slip=slip, rng=rng)
                alias = _alias(rng, named_alias_share if worlds is not None else 0.0)
                demos.append(
                    Demo(
                        demo.system,
                        _rename_world(demo.user, task.world, alias),
                        tuple(_rename_world(e, task.world, alias) for e in experiences),
                        demo.actions,
                        demo.observations,
                        task.world,
                    )
                )
                continue
        other = None
        if rng.random() < convention_noise:
            other = rng.choice([w for w in names if w != task.world])
        demo, _, _ = play(task, conventions_world=other, slip=slip, rng=rng, worlds=worlds)
        demos.append(demo)
    return demos


def encode_demo(demo: Demo, codec: ChatCodec) -> TrajectoryIds:
    traj = codec.start(demo.system, demo.user, list(demo.experiences) or None)
    for i, action in enumerate(demo.actions):
        traj.add_action(codec.action_ids(action))
        if i < len(demo.observations):
            traj.add_forced(codec.observation_ids(demo.observations[i]))
    return traj

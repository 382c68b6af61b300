"""The cold start's data: oracle successes in the *pretraining* worlds, never in a deployment world.

φ0 learns to turn retrieved successes into latents the frozen base can read. It may learn that on oracle
demonstrations, because the pretraining worlds are the base's own training ground; a deployment world is
reached only through what the agent sampled there (its bank). So the cold start builds a bank of its own,
in a temporary folder, from `coldstart.oracle_tasks` oracle episodes on training tasks of the pretraining
worlds; each target retrieves its J nearest successes of the same world (never itself), exactly as
distillation retrieves from the deployment bank. Nothing here reads the deployment bank.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from lopd_core.bank import ExperienceBank
from lopd_core.config import Params
from lopd_core.envs import Task
from lopd_core.envs.mix import pretraining_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.codegen_demos import play_codegen
from lopd_core.model.demos import encode_demo, play
from lopd_core.rollout.engine import Trajectory
from lopd_core.rollout.table import trajectories_to_frame

ORACLE_SAMPLE_INDEX = -1  # marks oracle demonstrations in a trajectory table
COLDSTART_SEED_OFFSET = 202


class Success(NamedTuple):
    """What cold start reads of a successful trajectory."""

    token_ids: list[int]
    action_mask: list[int]
    task: Task


def oracle_trajectory(codec: ChatCodec, task: Task) -> Trajectory:
    """An oracle episode as a trajectory: ids built as the warm start builds demonstrations, the oracle's
    actions marked as actions, sample log-probs 0 (they were not sampled from the policy)."""
    demo, success, episode = play_codegen(task) if task.env == "codegen" else play(task)
    ids = encode_demo(demo, codec)
    prompt_length = ids.action_mask.index(1)
    return Trajectory(
        task,
        ORACLE_SAMPLE_INDEX,
        (),
        ids.token_ids,
        ids.action_mask,
        ids.sample_logprobs,
        prompt_length,
        reward=1.0 if success else 0.0,
        success=success,
        stop_reason="answer",
        num_turns=len(demo.actions),
        episode=episode,
    )


def pretraining_successes(params: Params, codec: ChatCodec) -> tuple[list[Trajectory], list[Success]]:
    """Oracle successes on `coldstart.oracle_tasks` training tasks of the pretraining worlds."""
    tasks = pretraining_tasks(params.envs, params.coldstart.oracle_tasks, params.seed + COLDSTART_SEED_OFFSET)
    trajs = [t for t in (oracle_trajectory(codec, task) for task in tasks) if t.success]
    return trajs, [Success(list(t.token_ids), list(t.action_mask), t.task) for t in trajs]


@contextmanager
def pretraining_retriever(params: Params, trajectories: list[Trajectory]) -> Iterator[Callable]:
    """A retriever over the oracle successes (same world, never the task itself), indexed in a temporary
    Chroma folder that is gone when the block ends."""
    with tempfile.TemporaryDirectory(prefix="lopd-coldstart-") as tmp:
        root = Path(tmp)
        with ExperienceBank(
            root / "experience.parquet", index_dir=root / "index", hnsw={"ef_search": params.bank.ef_search}
        ) as bank:
            bank.refresh(
                trajectories_to_frame(trajectories),
                min_reward=params.bank.min_reward,
                policy_version="oracle-pretraining",
                cycle=0,
            )
            bank.ensure_index()

            most = params.coldstart.max_experiences

            def retrieve(tasks: list[Task]) -> list[list[str]]:
                return [
                    [h.experience_text for h in hits]
                    for hits in bank.retrieve(tasks, most or params.bank.top_j, False, same_world=True)
                ]

            yield varied_count(retrieve, most, params.seed + COLDSTART_SEED_OFFSET)


def varied_count(retrieve: Callable, most: int, seed: int) -> Callable[[list[Task]], list[list[str]]]:
    """A retriever that keeps, per task and call, its nearest J rows with J drawn uniformly from 1..`most` (a
    seeded stream): φ then learns to read any number of experiences up to `most` rather than always
    bank.top_j, so that more rows at play time can help instead of reading as out of distribution
    (`coldstart.max_experiences`; the warm start's `model.warmstart.max_experiences` does the same for the
    base). `retrieve` must return at least `most` rows where the bank has them; `most` 0 is `retrieve` itself."""
    if not most:
        return retrieve
    rng = random.Random(seed)

    def pick(tasks: list[Task]) -> list[list[str]]:
        return [rows[: rng.randint(1, most)] for rows in retrieve(tasks)]

    return pick

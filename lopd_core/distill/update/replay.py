"""Replay: a share of every distillation batch is tasks of earlier worlds, so that training prevents forgetting
instead of the cycle's guards only catching it (DESIGN §3, "Continual cycles"; issue #46).

Measured: one cycle takes pretrain_test (held-out tasks of the pretraining worlds) from 26 to 18 %, three cycles
25 → 15 %. With `lopd.replay_share` > 0, round(share · tasks_per_step) of each step's tasks are *replay tasks*:
training tasks of the pretraining worlds (the warm start's) and of `lopd.replay_worlds` (earlier deployment
worlds; `lopd cycle` adds every world an earlier cycle deployed to). On a replay task the teacher reads no
experience — the retriever is not asked, so the teacher is its weights alone: for LOPD the frozen teacher base,
which under `cycle.refresh_teacher` is the champion — and the student distils toward that base's own distribution
on the student's own samples there: an on-policy KL to the base on old prompts (the literature's replay cut
forgetting by 42–46 %). For the policy-gradient methods a replay task is one more RL task. A teacher whose
context does not come from the bank (OPSD's solution, SDPO's sibling) reads it on replay tasks as on any other.

What replay is not: the replay tasks' rollouts never join the growing bank (they are not the deployment world's
experience), but they are charged as rollouts, and they count in the step's reward, δ̄ and token means like a
task that retrieved nothing. The dashboard's `replay_kl` is the token mean of KL(p_S,old ‖ p_T) over the replay
trajectories: with a frozen-base teacher, the student's KL to the base on old prompts, the quantity that predicts
forgetting.

Departure not measured yet: the issue also names a replay teacher that reads the old world's bank; this is the
KL-to-base form only. Everything is a function of (seed, step), so a resumed run draws the same replay tasks.
"""

from __future__ import annotations

from collections.abc import Callable

from lopd_core.envs import Task
from lopd_core.envs.mix import interleave, mix_counts, pretraining_tasks
from lopd_core.envs.tasks import make_tasks
from lopd_core.envs.toolworld.worlds import deploy_worlds
from lopd_core.settings.checks import ConfigError

REPLAY_SEED_OFFSET = 29  # the replay stream's seed, apart from the training stream's (+17) and the checks'
PRETRAINING = "(pretraining)"  # the pretraining worlds' share of the replay stream, one source among the worlds


def replay_tasks(envs, worlds: list[str], n: int, seed: int) -> list[Task]:
    """`n` training tasks of earlier worlds, interleaved: the pretraining worlds (as the warm start draws them) count
    as one source and each of `worlds` (earlier deployment worlds, toolworld's) as one, in equal shares — with 64
    pretraining worlds, an earlier world drawn among them would get 1/65 of the stream."""
    counts = mix_counts({PRETRAINING: 1.0, **dict.fromkeys(worlds, 1.0)}, n)
    streams = {PRETRAINING: pretraining_tasks(envs, counts[PRETRAINING], seed)}
    for w in worlds:
        streams[w] = make_tasks("toolworld", "train", counts[w], seed, deploy_worlds([w]))
    return interleave(streams)


def check_worlds(worlds: list[str], envs) -> None:
    """An earlier world is not one the run deploys to (its tasks would read no experience in their own world)."""
    both = sorted(set(worlds) & set(envs.deploy_worlds))
    if both:
        raise ConfigError(
            f"lopd.replay_worlds: got {both[0]!r}, which envs.deploy_worlds trains in, expected earlier worlds "
            "only (a world the run deploys to is trained with its experience, not replayed)"
        )
    if worlds and "toolworld" not in envs.mix:
        raise ConfigError(
            f"lopd.replay_worlds: got {worlds!r} with envs.mix={dict(envs.mix)!r}, expected []: named worlds "
            "are toolworld's, and the mix has no toolworld"
        )


class ReplayStream:
    """The replay tasks of a run, in blocks of `steps` steps like the training stream (block b has its own seed),
    and which tasks are replay tasks (`is_replay`: every task a block has drawn)."""

    def __init__(self, envs, worlds: list[str], *, per_step: int, steps: int, seed: int):
        """`per_step`: replay tasks per step (`LopdConfig.replay_per_step`; 0: none, and nothing is drawn)."""
        check_worlds(worlds, envs)
        self.envs, self.worlds, self.per_step, self.steps, self.seed = envs, list(worlds), per_step, steps, seed
        self._blocks: dict[int, list[Task]] = {}
        self._drawn: set[Task] = set()

    def step_tasks(self, block: int, within: int) -> list[Task]:
        """The replay tasks of step `within` of block `block`."""
        if not self.per_step:
            return []
        if block not in self._blocks:
            tasks = replay_tasks(
                self.envs, self.worlds, self.steps * self.per_step, self.seed + REPLAY_SEED_OFFSET + 1_000_003 * block
            )
            self._blocks[block] = tasks
            self._drawn.update(tasks)
        return self._blocks[block][within * self.per_step : (within + 1) * self.per_step]

    def is_replay(self, task: Task) -> bool:
        return task in self._drawn


def with_replay(fresh: list[Task], replay: list[Task]) -> list[Task]:
    """A step's tasks: the replay tasks spread evenly among the fresh ones (every rank's contiguous slice under
    `accelerate launch` then holds close to the share)."""
    return interleave({"fresh": fresh, "replay": replay}) if replay else fresh


def never_replay(task: Task) -> bool:
    return False


IsReplay = Callable[[Task], bool]

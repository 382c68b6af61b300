"""Annealed distillation (`lopd_rl_annealed`; ATOD / RetireOPD in DESIGN §3 "Reward-led arms"): the
distillation term's weight falls as the student reaches the teacher's measured level, so the reward alone
drives the student once the teacher has nothing left to teach.

The weight of a step is 1 − s_S / s_T, clipped to [0, 1]: s_T is the latent teacher's success on
`baselines.anneal_check_n` train-split tasks, played once at the start with the rollouts' sampling (the
refresh check's fixed tasks: never a held-out split), s_S the student's success on its own batches over the
last `baselines.anneal_window` steps, this one included (free: those rollouts were sampled to train on). The
teacher's episodes are counted apart from the training rollouts (`DistillState.check_episodes`), as the gated
refresh's are. A teacher that was never measured (a Distiller driven by hand, step by step) weighs 1.
"""

from __future__ import annotations

import statistics

import torch

from lopd_core import distributed as D
from lopd_core.distill.composer.composer import compose_latents
from lopd_core.distill.teacher.teacher_rollout import latent_rollout
from lopd_core.distill.update.state import DistillState
from lopd_core.envs import Task
from lopd_core.rollout.engine import RolloutRequest, Sampling


def anneal_scale(teacher_level: float | None, recent_success: list[float]) -> float:
    """1 − s_S / s_T in [0, 1]; 1 with no measured teacher, 0 with a teacher that never succeeded (it has no
    level to lead the student to)."""
    if teacher_level is None:
        return 1.0
    if teacher_level <= 0:
        return 0.0
    student = statistics.fmean(recent_success) if recent_success else 0.0
    return min(1.0, max(0.0, 1.0 - student / teacher_level))


def step_scale(window: int, state: DistillState, trajs: list) -> float:
    """This step's weight (window 0: no anneal, 1), after adding the step's batch success (every rank's) to
    the student's recent level; kept in `state.distill_scale` for the dashboard."""
    if window <= 0:
        return 1.0
    wins = D.gather_lists([float(t.success) for t in trajs])
    state.recent_success = [*state.recent_success, statistics.fmean(wins) if wins else 0.0][-window:]
    state.distill_scale = anneal_scale(state.teacher_level, state.recent_success)
    return state.distill_scale


@torch.no_grad()
def teacher_level(models, tasks: list[Task], sampling: Sampling, *, seed: int) -> float:
    """The latent teacher's success on `tasks`, one sampled episode each: the frozen base with the composer's
    latents of each task's retrieved rows, as distillation conditions it."""
    experiences = models.retriever(tasks)
    latents = compose_latents(models.composer, models.encoder, experiences, models.queries_of(tasks))
    with models.teacher_lm("frozen_base") as lm:
        played = latent_rollout(
            lm,
            models.tokenizer,
            [RolloutRequest(t) for t in tasks],
            [x.detach() for x in latents],
            sampling=sampling,
            seed=seed,
        )
    return statistics.fmean(float(t.success) for t in played) if played else 0.0

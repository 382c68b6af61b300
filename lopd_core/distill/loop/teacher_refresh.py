"""The gated teacher refresh of `lopd_gated_refresh` (DESIGN §3, the ways past the teacher's ceiling).

A distilled student stops at its teacher: once it matches the frozen base θ̄ with latents, the reverse KL has
nothing left to pull it toward. `cycle.refresh_teacher` moves θ̄ to the promoted student between cycles; this
moves it within a stage, and only when a held-out check shows the student ahead — gated, not on a clock, so a
student that has not overtaken its teacher never teaches itself.

The check (`refresh_check`, every `baselines.refresh_check_every` steps):
  * tasks: `baselines.refresh_check_n` train-split tasks of the deployment worlds from their own seed stream
    (`check_tasks`), the same tasks at every check. The check decides what trains next, so it reads no test_id or
    test_ood task (those stay the final evaluation's); its own stream keeps it apart from the training batches
    (compare's learning-rate validation draws the same way);
  * decoding: greedy, no experience in context: what the weights know, not how sharp they are (evaluation.py);
  * decision: refresh where the student's `baselines.refresh_metric` (success rate or mean reward) exceeds the
    teacher base's by more than `baselines.refresh_min_gain`.
It is cheap: the teacher base is played once, at the first check; after a refresh the new θ̄ is the student that
was just scored, and greedy decoding of the same weights on the same tasks plays the same episodes, so its score
is the student's. Each later check plays the student alone. The check's episodes are evaluation, not training
samples: they are counted apart (`DistillState.check_episodes`), not in the run's `rollouts`.

Refreshing (`refresh_teacher_weights`):
  * full fine-tuning: the student's weights are copied into the teacher's frozen copy, in place (no new memory);
  * LoRA with one copy (the teacher is the base with the adapter off): the adapter is merged into the base and a
    fresh adapter (A re-initialised, B = 0) starts from there, so the student's function is unchanged and the
    adapter-off teacher is exactly the student at the check. The adapter's optimizer moments belong to the old
    adapter and are dropped (the trainer clears them);
  * LoRA with a separate teacher copy (`lopd cycle` with cycle.refresh_teacher false): the merged student is
    copied into it.
The experience encoder reads θ̄ (composer.py), so it reads the refreshed base from then on, as a cycle with
cycle.refresh_teacher does; its cached encodings and φ0's cached anchor latents are dropped with the old base.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from lopd_core import distributed as D
from lopd_core.distill.update.dashboard import UpdateResult
from lopd_core.distill.update.inputs import StepModels
from lopd_core.distill.update.state import DistillState
from lopd_core.envs import Task
from lopd_core.envs.mix import deployment_tasks
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

REFRESH_SEED_OFFSET = 303  # the check's tasks come from their own seed stream (training draws seed + 17, bank 101)
METRICS = ("success", "reward")


@dataclass(frozen=True)
class CheckScore:
    """One policy's greedy result on the check's tasks (every rank's share summed)."""

    success_rate: float
    reward_mean: float
    n: int

    def value(self, metric: str) -> float:
        if metric not in METRICS:
            raise ValueError(f"refresh metric: got {metric!r}, expected one of {', '.join(METRICS)}")
        return self.success_rate if metric == "success" else self.reward_mean

    def to_dict(self) -> dict:
        return asdict(self)


def check_tasks(params) -> list[Task]:
    """The check's tasks: `baselines.refresh_check_n` train-split tasks of the deployment worlds, seeded by the
    run's seed alone, so every check (and a resumed run's) plays the same ones."""
    return deployment_tasks(params.envs, "train", params.baselines.refresh_check_n, params.seed + REFRESH_SEED_OFFSET)


def greedy_score(lm, codec, tasks: list[Task], rollout_cfg, *, seed: int = 0) -> CheckScore:
    """`lm` plays `tasks` greedily without experience; under data parallelism each rank plays its contiguous
    share and the counts are summed, so every rank reaches the same decision."""
    mine = D.shard_range(len(tasks))
    sampling = Sampling(
        temperature=0.0,
        top_p=rollout_cfg.top_p,
        max_new_tokens=rollout_cfg.max_new_tokens,
        max_context=rollout_cfg.max_context,
        max_observation_tokens=rollout_cfg.max_observation_tokens,
    )
    requests = [RolloutRequest(t) for t in tasks[mine.start : mine.stop]]
    trajs = rollout(lm, codec, requests, sampling=sampling, batch_size=rollout_cfg.batch_size, seed=seed)
    wins, reward = D.global_sum([float(sum(t.success for t in trajs)), float(sum(t.reward for t in trajs))])
    n = len(tasks)
    return CheckScore(wins / max(n, 1), reward / max(n, 1), n)


def should_refresh(student: CheckScore, teacher: CheckScore, *, metric: str, min_gain: float) -> bool:
    """The gate: the student ahead of the teacher base by more than `min_gain` on `metric` (a tie never
    refreshes: with min_gain 0 the student must be strictly ahead)."""
    return student.value(metric) - teacher.value(metric) > min_gain


@torch.no_grad()
def refresh_teacher_weights(trainable, student_lm, view) -> bool:
    """θ̄ ← the student (module docstring says how, per student mode). Returns True when the student's adapter
    was merged and restarted (LoRA, one copy): its optimizer state no longer applies."""
    if view.adapter_owner is not None:
        _merge_adapter_into_base(view.adapter_owner)
        return True
    if hasattr(trainable, "merge_and_unload"):  # LoRA student, separate teacher copy: the merged student
        source = copy.deepcopy(trainable).merge_and_unload().state_dict()
    else:
        source = student_lm.state_dict()
    view.lm.load_state_dict(source)
    return False


def _merge_adapter_into_base(peft_model) -> None:
    """W ← W + ΔW of every LoRA layer, then a fresh adapter (A as PEFT initialises it, B = 0, so ΔW = 0): the
    student computes what it computed, and the base — the adapter-off teacher — is now that student."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in list(module.lora_A.keys()):
            base = module.get_base_layer()
            base.weight.add_(module.get_delta_weight(name).to(base.weight.dtype))
            module.reset_lora_parameters(name, True)


def refresh_check(
    models: StepModels,
    state: DistillState,
    baselines,
    scorer: Callable[[object], CheckScore],
    out: UpdateResult,
    *,
    log,
) -> None:
    """The held-out check after this step, and θ̄ ← student where the student is ahead (module docstring). The
    teacher base is scored once (by `scorer`); after a refresh its score is the student's. Fills the step's row
    and diagnostics with the check's figures."""
    b = baselines
    student = scorer(models.student)
    if state.refresh_teacher_score is None:
        with models.teacher.active() as lm:
            teacher = scorer(lm)
    else:
        teacher = CheckScore(**state.refresh_teacher_score)
    refreshed = should_refresh(student, teacher, metric=b.refresh_metric, min_gain=b.refresh_min_gain)
    if refreshed:
        if refresh_teacher_weights(models.trainable, models.student, models.teacher):
            models.opt_theta.state.clear()  # a fresh adapter: the old one's moments do not apply
        models.encoder.cache.clear()  # encodings and φ0's latents of the old base
        models.anchor.clear()
        state.teacher_refreshes += 1
    state.refresh_teacher_score = (student if refreshed else teacher).to_dict()
    state.refresh_checks.append(
        {
            "step": state.step,
            "metric": b.refresh_metric,
            "student": student.to_dict(),
            "teacher": teacher.to_dict(),
            "refreshed": refreshed,
        }
    )
    out.row = replace(out.row, teacher_refreshes=state.teacher_refreshes)
    out.diagnostics.update(
        refresh_student=student.value(b.refresh_metric), refresh_teacher=teacher.value(b.refresh_metric)
    )
    verdict = (
        f"refreshed (θ̄ ← student, refresh {state.teacher_refreshes})"
        if refreshed
        else f"kept (needs a gain > {b.refresh_min_gain:g})"
    )
    log(
        f"distill: step {state.step}: teacher refresh check ({student.n} held-out train tasks, greedy, "
        f"{b.refresh_metric}): student {student.value(b.refresh_metric):.3f} vs teacher base "
        f"{teacher.value(b.refresh_metric):.3f} -> {verdict}"
    )

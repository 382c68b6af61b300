"""The dashboard row of one step (`plots/distill.csv`, DESIGN §5) and its diagnostics row, built from what the
chunks of `update` accumulated.

`DashboardRow`'s fields are the CSV's columns, in order: the CSV and MLflow read the dataclass, so a column is
added in one place. Every figure is a whole-batch one (every rank's trajectories, in rank = task order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

import torch

from lopd_core import distributed as D
from lopd_core.distill.update import margin as MG
from lopd_core.distill.update import step as S
from lopd_core.distill.update.inputs import StepModels, StepSetup
from lopd_core.distill.update.state import DistillState


@dataclass(frozen=True)
class DashboardRow:
    """One row of plots/distill.csv (DESIGN §5); NaN where a figure has no value for the method."""

    step: int  # steps completed, this one included
    rollouts: int  # trajectories sampled so far, including the bank's seed rollouts and refreshes
    reward_mean: float
    success_rate: float
    distill_loss: float  # the student loss, a token mean over the batch
    kl_phi: float  # KL(sg[p_S,old] ‖ p_T,φ), a token mean
    delta: float  # δ̄: the mean over trajectories of δ(τ)
    beta: float  # the β of this step's composer loss (the next row's is after the dual ascent)
    margin: float | None  # m in force (None: `lopd.margin: auto`, not priced)
    delta_success: float  # δ̄'s part on successful trajectories (margin.delta_parts)
    delta_failure: float  # δ̄'s part on failed ones
    anchor: float  # mean((c_φ − c_φ0)²)
    kl_text: float  # the reading term's KL(p_text ‖ p_latent), a token mean on its rows (reading.py); 0 when off
    student_entropy: float  # token means over the batch
    teacher_entropy: float
    topk_mass: float  # the teacher's mass on its top-k ids
    grad_norm_theta: float  # before clipping
    grad_norm_phi: float
    latent_norm_ratio: float  # mean latent norm / mean token-embedding norm
    step_seconds: float
    phase: int  # index of the method phase the step trained (methods.method_phases)
    teacher_refreshes: int  # θ̄ ← student refreshes so far (lopd_gated_refresh)
    flat_groups: float  # share of the step's task groups whose rewards are all equal (GRPO's advantage is 0)
    failed_groups: float  # share of the groups where every sample failed
    distill_weight: float  # the distillation term's weight in force (lopd_rl_annealed's fades; else 1)
    # KL(p_S,old ‖ p_T) on the replay trajectories (lopd.replay_share, replay.py), a token mean on the teacher's top-k
    # + tail: their teacher reads nothing, so with a frozen-base teacher this is the KL to the base on old prompts,
    # what predicts forgetting; NaN in a step without replay tasks (or without a teacher pass)
    replay_kl: float


CSV_COLUMNS = [f.name for f in fields(DashboardRow)]
DIAGNOSTIC_COLUMNS = [
    "step",
    "margin_success",
    "margin_failure",
    "latent_norm",
    "embedding_norm",
    "skipped_updates",
    "encoder_cache_hits",
    "rollout_s",
    "teacher_s",
    "student_s",
    "composer_s",
    "refresh_student",
    "refresh_teacher",
]
# The teacher's columns, without value when a step runs no teacher (GRPO without a reference KL): NaN rather
# than a misleading 0.
TEACHER_COLUMNS = (
    "kl_phi",
    "delta",
    "teacher_entropy",
    "topk_mass",
    "delta_success",
    "delta_failure",
    "replay_kl",
)


@dataclass
class ComposerStep:
    """Step 4's figures for the row."""

    anchor: float  # mean((c_φ − c_φ0)²) over every rank's latents
    grad_norm: float
    latent_norm: float  # mean norm of a latent vector, every rank's
    kl_text: float = 0.0  # the reading term's KL, a token mean on its rows (reading.py)


@dataclass
class UpdateResult:
    """What one training update reports (named apart from `lopd_core.envs.StepResult`, one environment step)."""

    row: DashboardRow  # plots/distill.csv
    diagnostics: dict  # plots/distill_diagnostics.csv (DIAGNOSTIC_COLUMNS)
    trajectory_gaps: list[float]  # per trajectory (every rank's, in task order): mean log p_T,φ − log p_S,old
    trajectory_kl: list[float]  # per trajectory: mean KL(p_S,old ‖ p_T,φ) over its action tokens
    trajectories: list = field(default_factory=list)  # this rank's rollouts of the step (a growing bank's input)


def step_result(
    setup: StepSetup,
    models: StepModels,
    state: DistillState,
    batch: S.RolloutBatch,
    sums: S.StepSums,
    *,
    totals: dict[str, float],
    beta: float,
    grad_theta: float,
    composer: ComposerStep,
    started: float,
    rollout_s: float,
    trajectories: list,
) -> UpdateResult:
    """The dashboard row and the diagnostics, from the sums the chunks accumulated; `trajectories` are this
    rank's (a growing bank reads them)."""
    counts = batch.token_counts.clamp(min=1)
    rewards = torch.tensor(D.gather_lists(batch.rewards.tolist()), dtype=torch.float32)
    successes = torch.tensor(D.gather_lists(batch.successes.tolist()), dtype=torch.bool)
    per_traj_gap = torch.tensor(D.gather_lists((sums.gap.cpu() / counts).tolist()))
    per_traj_kl = D.gather_lists((sums.kl.cpu() / counts).tolist())
    # δ(τ) = A(τ) · its mean gap, the δ̄ terms: its parts on successes and failures (margin.delta_parts)
    advantage = torch.tensor(D.gather_lists(batch.advantage.cpu().tolist()))
    all_counts = torch.tensor(D.gather_lists(batch.token_counts.tolist()))
    delta_success, delta_failure = MG.delta_parts(advantage * per_traj_gap, all_counts, successes)
    n = batch.n_tokens
    values = {
        "step": state.step,
        "rollouts": state.rollouts,
        "reward_mean": float(rewards.mean()),
        "success_rate": float(successes.float().mean()),
        "distill_loss": totals["distill"],
        "kl_phi": totals["kl"],
        "delta": totals["delta"],
        "beta": beta,
        "margin": setup.margin(state),
        "delta_success": delta_success,
        "delta_failure": delta_failure,
        "anchor": composer.anchor,
        "kl_text": composer.kl_text,
        "student_entropy": totals["student_entropy"] / n,
        "teacher_entropy": totals["teacher_entropy"] / n,
        "topk_mass": totals["topk_mass"] / n,
        "grad_norm_theta": grad_theta,
        "grad_norm_phi": composer.grad_norm,
        "latent_norm_ratio": composer.latent_norm / max(models.embedding_norm, 1e-8),
        "step_seconds": time.perf_counter() - started,
        "phase": setup.phase,
        "teacher_refreshes": state.teacher_refreshes,
        **group_shares(batch),
        "distill_weight": state.distill_scale if setup.student_loss.anneal_window else 1.0,
        "replay_kl": replay_kl(sums.kl, batch.token_counts, [models.is_replay(t.task) for t in trajectories]),
    }
    if not setup.teacher_pass:
        values.update(dict.fromkeys(TEACHER_COLUMNS, math.nan))
    diag = diagnostics_row(models, state, sums, composer, gaps=per_traj_gap, successes=successes, rollout_s=rollout_s)
    # Per trajectory: mean over its action tokens of log p_T,φ − log p_S,old, what δ(τ) weighs by A(τ)
    # (probes/margin_probe.py reads it to price margins and advantages).
    return UpdateResult(DashboardRow(**values), diag, per_traj_gap.tolist(), per_traj_kl, trajectories)


def replay_kl(kl_sums: torch.Tensor, token_counts: torch.Tensor, replay: list[bool]) -> float:
    """The token mean of KL(p_S,old ‖ p_T) on the replay rows (lopd.replay_share, replay.py), every rank's: Σ over
    the replay trajectories of their KL sums (B,) / Σ of their action tokens (B,); `replay` (B,) this rank's flags.
    NaN where no replay row has an action token."""
    rows = zip(D.gather_lists(kl_sums.cpu().tolist()), D.gather_lists(token_counts.tolist()), D.gather_lists(replay))
    picked = [(k, n) for k, n, r in rows if r]
    tokens = sum(n for _, n in picked)
    return sum(k for k, _ in picked) / tokens if tokens else math.nan


def group_shares(batch: S.RolloutBatch) -> dict[str, float]:
    """Shares of the step's groups (every rank's) that carry no reward signal: all rewards equal, all failed."""
    flat = D.gather_lists(batch.flat_group.tolist())
    failed = D.gather_lists(batch.failed_group.tolist())
    n = max(len(flat), 1)  # per trajectory, so each group weighs by its size: G samples each in a step's batch
    return {"flat_groups": sum(flat) / n, "failed_groups": sum(failed) / n}


def diagnostics_row(
    models: StepModels,
    state: DistillState,
    sums: S.StepSums,
    composer: ComposerStep,
    *,
    gaps: torch.Tensor,
    successes: torch.Tensor,
    rollout_s: float,
) -> dict:
    """The diagnostics row (DIAGNOSTIC_COLUMNS): margins by outcome, norms, skips, cache hits, phase times;
    `gaps` (B,) and `successes` (B,) are every rank's, per trajectory (its mean log p_T,φ − log p_S,old)."""
    return {
        "step": state.step,
        "margin_success": float(gaps[successes].mean()) if successes.any() else float("nan"),
        "margin_failure": float(gaps[~successes].mean()) if (~successes).any() else float("nan"),
        "latent_norm": composer.latent_norm,
        "embedding_norm": models.embedding_norm,
        "skipped_updates": state.skipped_updates,
        "encoder_cache_hits": models.encoder.hits,
        "rollout_s": rollout_s,
        "teacher_s": sums.seconds["teacher"],
        "student_s": sums.seconds["student"],
        "composer_s": sums.seconds["composer"],
        "refresh_student": math.nan,
        "refresh_teacher": math.nan,  # filled on a step that ran the check
    }

"""What a distillation run changes as it goes, besides the weights: the step, β, the priced margin, counters.

Why a module of its own: every part of the step reads or advances it (the update moves β and the step, the
margin pricing sets m, the refresh check counts refreshes) and the checkpoint stores it, so it sits below all of
them; the trainer owns the one instance of a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DistillState:
    step: int = 0  # steps completed
    beta: float = 0.0
    rollouts: int = 0  # trajectories sampled so far (including the bank's seed rollouts)
    skipped_updates: int = 0
    history: list[dict] = field(default_factory=list)
    margin: float | None = None  # m priced for `lopd.margin: auto` (margin.py); None: not priced (or m is a number)
    margin_pricing: dict = field(default_factory=dict)  # how it was priced (PricedMargin.summary)
    # lopd_gated_refresh (teacher_refresh.py): refreshes of θ̄ so far, the teacher base's last check score (None:
    # not measured yet), every check's figures, and the episodes the checks played (not training rollouts)
    teacher_refreshes: int = 0
    refresh_teacher_score: dict | None = None
    refresh_checks: list[dict] = field(default_factory=list)
    check_episodes: int = 0
    # lopd_rl_annealed (anneal.py): the latent teacher's measured success (None: not measured), the student's
    # batch success over the last steps, and the distillation weight of the last step
    teacher_level: float | None = None
    recent_success: list[float] = field(default_factory=list)
    distill_scale: float = 1.0

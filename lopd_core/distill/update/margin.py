"""The margin priced, not assumed (DESIGN §3): `lopd.margin: auto`, δ̄'s parts, and whether β stayed bounded.

m is in nats per action token of the teacher's advantage on the student's own tokens, and what experience can
buy depends on the base and the bank: a constant m that the initial teacher does not come near on successes can
only be met by pushing the teacher away from the student on failures (their A(τ) < 0), and β then grows
without bound. So with `lopd.margin: auto` m is priced once, before the first step, from the gap the initial
teacher (frozen base + φ0's latents) shows on successful trajectories:

    gap = mean over successful trajectories τ of  mean over τ's action tokens of (log p_T,φ0(a) − log p_S(a))
    m   = lopd.margin_fraction · max(gap, 0)

The trajectories are the bank's stored seed rollouts that succeeded (`lopd bank` keeps their token ids in
seed_rollouts.parquet), scored by the teacher with retrieval that excludes the task's own bank rows (the bank
holds these very successes: reading its own trajectory back would price copying, not experience); where there
are none (no seed table, no success in it) the first step's successful rollouts, scored by the same teacher
pass the step runs anyway (the composer is still φ0 then), with the run's own retrieval. The mean is over
trajectories, each one vote, the reduction of δ̄ itself (losses.py says why), so that m and δ̄'s success part
(at A = 1: a success under `continuous` and `binary`) are the same quantity. Under `group` a success's advantage
is 1 − its group's mean reward, below 1, so the same m is harder to meet there.

gap ≤ 0 (or no success to price on): privilege alone cannot meet any positive m, so m = 0, and the log says so.
The priced m is kept in the checkpoint (`DistillState.margin`): a resumed run keeps it and never re-prices. A
method's own margin (`lopd_no_margin`: 0) wins over `auto`, as it wins over a number.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# β bounded (`beta_unbounded`): the last quarter of the run's steps, at least this many step-to-step changes ...
BETA_WINDOW_SHARE = 0.25
BETA_MIN_WINDOW = 4
# ... β rose in at least this share of them ...
BETA_RISE_SHARE = 0.9
# ... and ends above this: the margin term β·(m − δ̄) then outweighs the composer's KL, whose weight is 1.
BETA_UNBOUNDED_ABOVE = 1.0
# Seed successes priced on at most (a seeded subset beyond it): the price is a mean, not a census.
MAX_PRICING_TRAJECTORIES = 256


@dataclass(frozen=True)
class PricingTrajectory:
    """A stored successful rollout to price on: its task (for retrieval) and the ids the policy produced."""

    task: object  # lopd_core.envs.Task
    token_ids: list[int]
    action_mask: list[int]


@dataclass(frozen=True)
class PricingSource:
    """What `lopd.margin: auto` is priced on before the first step: stored successes and the retriever their
    teacher reads through (one that leaves out each task's own bank rows)."""

    trajectories: list[PricingTrajectory]
    retriever: object  # tasks -> experience texts per task, as the trainer's Retriever


@dataclass(frozen=True)
class PricedMargin:
    """The outcome of pricing: m, the gap it came from, and on what."""

    margin: float
    gap: float  # nan when there was no successful trajectory to price on
    trajectories: int  # successful trajectories with action tokens the gap is the mean over
    fraction: float
    source: str  # "bank seed successes" | "step 1 successes"

    def summary(self) -> dict:
        """Plain data for the checkpoint and the run summary."""
        return {
            "margin": self.margin,
            "gap": self.gap if math.isfinite(self.gap) else None,
            "trajectories": self.trajectories,
            "fraction": self.fraction,
            "source": self.source,
        }

    def message(self) -> str:
        """The one log line that says what m is and why."""
        if self.trajectories == 0:
            return (
                f"distill: margin: auto: no successful trajectory among the {self.source} to price m on; "
                "m = 0 (the constraint δ̄ ≥ m is not enforced by privilege)"
            )
        head = (
            f"distill: margin: auto: the initial teacher's gap on {self.trajectories} {self.source} is "
            f"{self.gap:+.4f} nats/token"
        )
        if self.gap <= 0:
            return (
                f"{head}: not above 0, so the constraint cannot be met by privilege; m = 0 "
                "(δ̄ ≥ m would be bought only by pushing the teacher away from the student on failures)"
            )
        return f"{head}; m = {self.fraction:g} × gap = {self.margin:.4g}"


def mean_over_successes(values: Tensor, token_counts: Tensor, successes: Tensor) -> tuple[float, int]:
    """The mean of per-trajectory `values` (B,) over the successful trajectories that have action tokens
    (token_counts (B,) > 0, successes (B,) bool), and how many there were; (nan, 0) when none."""
    keep = successes.to(torch.bool) & (token_counts > 0)
    n = int(keep.sum())
    return (float(values[keep].double().mean()) if n else math.nan), n


def price(gap: float, trajectories: int, fraction: float, source: str) -> PricedMargin:
    """m = fraction · max(gap, 0); 0 when there was nothing to price on (gap nan, trajectories 0)."""
    if trajectories == 0 or not math.isfinite(gap):
        return PricedMargin(0.0, math.nan, 0, fraction, source)
    return PricedMargin(float(fraction) * max(float(gap), 0.0), float(gap), int(trajectories), fraction, source)


def delta_parts(deltas: Tensor, token_counts: Tensor, successes: Tensor) -> tuple[float, float]:
    """δ̄'s parts: the mean of δ(τ) over the successful and over the failed trajectories with action tokens,
    the same reduction as δ̄ (one vote per trajectory), so δ̄ = (n_s·δ_s + n_f·δ_f) / (n_s + n_f) with n counting
    those trajectories. nan for a part whose trajectories the batch has none of (the CSV writes `nan`, as for
    kl_phi without a teacher): an absent part is not a part equal to 0."""
    scored = token_counts > 0
    ok = successes.to(torch.bool)
    parts = []
    for keep in (scored & ok, scored & ~ok):
        parts.append(float(deltas[keep].double().mean()) if bool(keep.any()) else math.nan)
    return parts[0], parts[1]


def beta_unbounded(betas: list[float]) -> bool:
    """Did β keep growing? `betas` the β of every step in order, the run's final β (after the last dual ascent)
    last. True when, over the last quarter of the run's step-to-step changes (at least BETA_MIN_WINDOW of them;
    a shorter run says False), β rose in at least BETA_RISE_SHARE of them and ends above BETA_UNBOUNDED_ABOVE.
    β ← max(0, β + η_β·(m − δ̄)) rises exactly while δ̄ < m, so this says the constraint stayed violated to the
    end and the margin term came to outweigh the composer's KL: m asks for more than the teacher holds."""
    values = [float(b) for b in betas if math.isfinite(float(b))]
    changes = len(values) - 1
    window = max(BETA_MIN_WINDOW, math.ceil(BETA_WINDOW_SHARE * changes))
    if changes < BETA_MIN_WINDOW:
        return False
    tail = values[-(window + 1) :]
    rises = sum(1 for a, b in itertools.pairwise(tail) if b > a)
    return rises >= BETA_RISE_SHARE * window and values[-1] > BETA_UNBOUNDED_ABOVE


def beta_warning(betas: list[float]) -> str:
    """The one-line warning the log prints when `beta_unbounded`."""
    return (
        f"distill: warning: β kept growing (rose in at least {BETA_RISE_SHARE:.0%} of the last "
        f"{BETA_WINDOW_SHARE:.0%} of steps, ends at {betas[-1]:.3f} > {BETA_UNBOUNDED_ABOVE:g}): δ̄ stayed below "
        "m; price the margin from the teacher (lopd.margin=auto) or lower it"
    )

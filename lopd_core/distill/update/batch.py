"""The batch of one LOPD step (DESIGN §3): the rollouts as padded tensors with their normalisers, and how the
batch is cut into micro-batches and which chunks the composer learns from.

Why a module of its own: every phase of the step (step.py) reads a `RolloutBatch`, and the way it is cut into
chunks is what keeps the micro-batched gradients equal to the whole batch's (update.py); the phases' arithmetic
stays in step.py. Shapes: B trajectories (this rank's), T the longest trajectory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from lopd_core import distributed as D
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring import pg_losses as PG

# ---- the batch ----------------------------------------------------------------------------------------------


@dataclass
class RolloutBatch:
    """A step's trajectories as the update reads them, with the whole batch's normalisers."""

    token_ids: list[list[int]]  # (B, T_b)
    action_masks: list[list[int]]  # (B, T_b) 1 = sampled by the policy
    sample_logprobs: list[list[float]]  # (B, T_b) log-prob of each token under the sampler that drew it
    rewards: Tensor  # (B,) float32, CPU
    successes: Tensor  # (B,) bool, CPU
    token_counts: Tensor  # (B,) long, CPU: action tokens that are predicted (position 0 never is)
    advantage: Tensor  # (B,) A(τ) of δ, on the device
    pg_advantage: Tensor | None  # (B,) GRPO's group-relative advantage, when the loss is a policy gradient
    n_tokens: int  # action tokens of the whole batch, every rank's (≥ 1)
    n_scored: int  # trajectories with an action token, every rank's (≥ 1): δ̄'s denominator
    flat_group: Tensor | None = None  # (B,) bool, CPU: the trajectory's group has all rewards equal (GRPO: no signal)
    failed_group: Tensor | None = None  # (B,) bool, CPU: every sample of its group failed
    distill_weight: Tensor | None = None  # (B,) the distillation term's weight (reward-led arms); None: 1 everywhere

    def __len__(self) -> int:
        return len(self.token_ids)

    def rows(self, rows: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        return [self.token_ids[i] for i in rows], [self.action_masks[i] for i in rows]

    def action_sample_logprobs(self, rows: list[int], device) -> Tensor:
        """(n,) the sampler's log-probs at the action tokens of `rows`, in build_batch's order (row by row,
        positions ascending, position 0 never predicted)."""
        return torch.tensor(
            [lp for i in rows for lp, m in zip(self.sample_logprobs[i][1:], self.action_masks[i][1:]) if m],
            dtype=torch.float32,
            device=device,
        )


def group_flags(rewards: Tensor, successes: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
    """Per trajectory, (B,) bool each: its group's rewards are all equal (GRPO's advantage is 0 for every member:
    the reward is silent), and every sample of its group failed."""
    flat = torch.zeros(len(groups), dtype=torch.bool)
    failed = torch.zeros(len(groups), dtype=torch.bool)
    for g in groups.unique():
        members = groups == g
        flat[members] = bool(rewards[members].max() == rewards[members].min())
        failed[members] = not bool(successes[members].any())
    return flat, failed


def distill_weights(flat: Tensor, failed: Tensor, gate: str, scale: float) -> Tensor:
    """(B,) float32: the distillation term's weight per trajectory — the gate (`all`, `silent`: groups whose
    rewards are all equal, `failed`: groups where every sample failed) times the anneal's scale."""
    mask = {"all": torch.ones_like(flat), "silent": flat, "failed": failed}[gate]
    return mask.float() * scale


def rollout_batch(
    trajs: list,
    *,
    samples_per_task: int,
    advantage: str,
    group_std_eps: float | None,
    device,
    distill_gate: str | None = None,
    distill_scale: float = 1.0,
) -> RolloutBatch:
    """The step's view of `trajs` (samples_per_task consecutive samples per task). `group_std_eps` None: no
    policy-gradient advantage (the distillation losses need none). `distill_gate` None: the distillation term
    weighs every trajectory alike; else `distill_weights`' gate, times `distill_scale`."""
    masks = [t.action_mask for t in trajs]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    successes = torch.tensor([t.success for t in trajs], dtype=torch.bool)
    groups = torch.tensor([i // samples_per_task for i in range(len(trajs))])
    counts = torch.tensor([sum(1 for m in mask[1:] if m) for mask in masks], dtype=torch.long)
    # Under data parallelism B is this rank's shard and the normalisers every rank's: each rank's sums are its
    # share of the global means, and summing gradients over ranks gives the whole-batch gradient.
    n_tokens, n_scored = D.global_sum([int(counts.sum()), int((counts > 0).sum())])
    adv = L.advantages(rewards, kind=advantage, successes=successes, group_ids=groups).to(device)
    pg_adv = (
        None if group_std_eps is None else PG.group_relative_advantages(rewards, groups, eps=group_std_eps).to(device)
    )
    flat, failed = group_flags(rewards, successes, groups)
    weight = None if distill_gate is None else distill_weights(flat, failed, distill_gate, distill_scale).to(device)
    return RolloutBatch(
        [t.token_ids for t in trajs],
        masks,
        [list(t.sample_logprobs) for t in trajs],
        rewards,
        successes,
        counts,
        adv,
        pg_adv,
        max(int(n_tokens), 1),
        max(int(n_scored), 1),
        flat,
        failed,
        weight,
    )


def micro_batches(lengths: list[int], size: int, group: int = 1) -> list[list[int]]:
    """Indices of the rows in each micro-batch of at most `size` rows (0 = one batch, in the original order).

    Rows are grouped by length so that a chunk pads to little more than its own rows; every loss is a sum over
    rows divided by a whole-batch count, so the grouping changes no value. With `group` > 1, each run of
    `group` consecutive rows (a task's samples) stays in one chunk, ordered by its longest row — so a teacher
    that runs a shared prompt once per task (`lopd.share_prompt`) finds all its samples together. Shared with
    benchmarks/step_cost.py, whose policy-gradient baseline must chunk exactly as the trainer does.
    """
    if size <= 0 or size >= len(lengths):
        return [list(range(len(lengths)))] if lengths else []
    group = max(1, min(group, size))
    units = [list(range(s, min(s + group, len(lengths)))) for s in range(0, len(lengths), group)]
    units.sort(key=lambda u: max(lengths[i] for i in u))
    chunks: list[list[int]] = []
    for unit in units:
        if chunks and len(chunks[-1]) + len(unit) <= size:
            chunks[-1].extend(unit)
        else:
            chunks.append(list(unit))
    return chunks


def chunk_group(samples_per_task: int, share_prompt: bool) -> int:
    """Rows a micro-batch keeps together: a task's samples when the teacher shares their prompt, so it runs
    once per chunk; otherwise rows go wherever their length puts them."""
    return samples_per_task if share_prompt else 1


def composer_chunks(n_chunks: int, fraction: float, seed: int) -> set[int]:
    """Which chunks train the composer (`lopd.composer_fraction`): at least one when the fraction is > 0, from a
    shuffle seeded by `seed` (the trainer passes one of (seed, step), so a resumed run picks the same ones)."""
    k = n_chunks if fraction >= 1 else round(fraction * n_chunks)
    k = max(k, 1 if fraction > 0 else 0)
    order = list(range(n_chunks))
    random.Random(seed).shuffle(order)
    return set(order[:k])


@dataclass(frozen=True)
class ComposerScale:
    """The picked chunks' composer gradient rescaled to the whole batch (each term by its own denominator's
    share), unbiased for the full gradient; both 1 when every chunk is picked."""

    kl: float = 1.0  # batch tokens / picked chunks' tokens
    delta: float = 1.0  # batch trajectories with tokens / picked chunks' ones


def composer_scale(batch: RolloutBatch, chunks: list[list[int]], picked: set[int]) -> ComposerScale:
    rows = [i for c in picked for i in chunks[c]]
    tokens, scored = D.global_sum(
        [int(batch.token_counts[rows].sum()) if rows else 0, int((batch.token_counts[rows] > 0).sum()) if rows else 0]
    )
    return ComposerScale(batch.n_tokens / max(tokens, 1), batch.n_scored / max(scored, 1))

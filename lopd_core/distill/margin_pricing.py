"""`lopd.margin: auto` priced in a run (margin.py holds the arithmetic): before step 1 on the bank's seed
successes, else on step 1's own successes. A resumed run keeps the checkpoint's m."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from lopd_core import distributed as D
from lopd_core.distill import margin as MG
from lopd_core.distill import step as S
from lopd_core.distill.step import micro_batches
from lopd_core.distill.teacher import action_logits, build_batch
from lopd_core.distill.teacher_context import teacher_lm

if TYPE_CHECKING:
    from lopd_core.distill.trainer import Distiller, Retriever


def price_margin(d: Distiller) -> None:
    """Price m before the first step when `lopd.margin` is `auto`: on the stored successes of `d.pricing` (the
    bank's seed rollouts), scored by the initial teacher with φ0's latents against the initial student. With
    none, the first step prices it on its own successes (`price_on_batch`). A no-op when m is a number, the
    method's own, or already priced."""
    if d.margin is not None:
        return
    if not d.method.needs_composer:
        set_margin(
            d,
            MG.price(math.nan, 0, d.cfg.margin_fraction, "none"),
            f"distill: margin: auto: lopd.method={d.method.name!r} has no latent teacher to price m on; m = 0",
        )
        return
    rows = list(d.pricing.trajectories) if d.pricing is not None else []
    if not rows:
        d.log(
            "distill: margin: auto: no stored seed successes to price m on; step 1 prices it on its own "
            "successful rollouts"
        )
        return
    retriever = d.pricing.retriever or d.retriever
    gap, n = seed_gap(d, rows, retriever)
    set_margin(d, MG.price(gap, n, d.cfg.margin_fraction, "bank seed successes"))


def seed_gap(d: Distiller, rows: list[MG.PricingTrajectory], retriever: Retriever) -> tuple[float, int]:
    """The mean over `rows` (every rank's share of them) of each one's mean log p_T,φ0(a) − log p_S(a) at its
    action tokens, and how many rows had action tokens; no gradient, in micro-batches of the run's size. Rows
    too long to hold the teacher's splice within rollout.max_context are left out (the bank's rollouts did not
    reserve room for it)."""
    rows = [r for r in rows if len(r.token_ids) + d.splice_room <= d.params.rollout.max_context]
    part = rows[D.shard_range(len(rows)).start : D.shard_range(len(rows)).stop]
    total, n = 0.0, 0
    if part:
        experiences = retriever([r.task for r in part])
        queries = d.queries_of([r.task for r in part])
        latents = [x.to(d.composer.queries.device) for x in d.anchor_latents(experiences, queries)]  # φ0's, cached
        keys = [(queries[i] if queries else "", *experiences[i]) for i in range(len(part))]  # equal keys: equal latents
        ids, masks = [r.token_ids for r in part], [r.action_mask for r in part]
        with torch.no_grad():
            for chunk in micro_batches([len(i) for i in ids], d.cfg.micro_batch):
                sums, counts = _chunk_gaps(
                    d,
                    [ids[i] for i in chunk],
                    [masks[i] for i in chunk],
                    [latents[i] for i in chunk],
                    [keys[i] for i in chunk],
                )
                total += float((sums / counts.clamp(min=1))[counts > 0].sum())
                n += int((counts > 0).sum())
    total, n = D.global_sum([total, n])
    return (total / n if n else math.nan), int(n)


def _chunk_gaps(d: Distiller, ids, masks, latents, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a chunk: Σ over its action tokens of log p_T,φ0(a) − log p_S(a), and its action tokens."""
    with teacher_lm(d) as lm:
        scores = S.score_teacher(
            lm,
            ids,
            masks,
            latents,
            keys,
            framing=d.framing,
            share_prompt=d.cfg.share_prompt,
            top_k=d.cfg.top_k,
            temperature=d.method.teacher.temperature,
        )
    sbatch = build_batch(d.student, ids, masks)
    s_lp = torch.log_softmax(action_logits(d.student, sbatch), dim=-1)  # (n, V)
    if not torch.equal(sbatch.action_ids, scores.action_ids):
        raise RuntimeError("margin pricing: teacher and student disagree on the action tokens")
    gap = scores.action_logprobs - s_lp.gather(-1, sbatch.action_ids[:, None]).squeeze(-1)  # (n,)
    sums = torch.zeros(len(ids), device=gap.device).index_add_(0, scores.token_traj_index, gap.float())
    return sums, torch.bincount(scores.token_traj_index, minlength=len(ids))


def price_on_batch(d: Distiller, batch: S.RolloutBatch, sums: S.StepSums) -> None:
    """`lopd.margin: auto` with nothing stored to price on: this step's successes (the first step's, whose
    teacher pass ran with φ0's latents against the initial student, the same gap as on stored ones)."""
    if not d.method.needs_composer or not d.teacher_pass:
        price_margin(d)
        return
    counts = torch.tensor(D.gather_lists(batch.token_counts.tolist()))
    gaps = torch.tensor(D.gather_lists((sums.gap.cpu() / batch.token_counts.clamp(min=1)).tolist()))
    successes = torch.tensor(D.gather_lists(batch.successes.tolist()), dtype=torch.bool)
    gap, n = MG.mean_over_successes(gaps, counts, successes)
    set_margin(d, MG.price(gap, n, d.cfg.margin_fraction, f"step {d.state.step + 1} successes"))


def set_margin(d: Distiller, priced: MG.PricedMargin, message: str | None = None) -> None:
    d.state.margin, d.state.margin_pricing = priced.margin, priced.summary()
    d.log(message or priced.message())

"""`lopd.margin: auto` priced in a run (margin.py holds the arithmetic): before step 1 on the bank's seed
successes, else on step 1's own successes. A resumed run keeps the checkpoint's m."""

from __future__ import annotations

import math

import torch

from lopd_core import distributed as D
from lopd_core.distill.scoring.teacher import action_logits, build_batch
from lopd_core.distill.update import margin as MG
from lopd_core.distill.update import step as S
from lopd_core.distill.update.batch import RolloutBatch, micro_batches
from lopd_core.distill.update.inputs import Retriever, StepModels, StepSetup
from lopd_core.distill.update.state import DistillState


def price_margin(
    setup: StepSetup, models: StepModels, state: DistillState, pricing: MG.PricingSource | None, log
) -> None:
    """Price m before the first step when `lopd.margin` is `auto`: on the stored successes of `pricing` (the
    bank's seed rollouts), scored by the initial teacher with φ0's latents against the initial student. With
    none, the first step prices it on its own successes (`price_on_batch`). A no-op when m is a number, the
    method's own, or already priced."""
    if setup.margin(state) is not None:
        return
    if not setup.method.needs_composer:
        no_latent_teacher(setup, state, log)
        return
    rows = list(pricing.trajectories) if pricing is not None else []
    if not rows:
        log(
            "distill: margin: auto: no stored seed successes to price m on; step 1 prices it on its own "
            "successful rollouts"
        )
        return
    gap, n = seed_gap(setup, models, rows, pricing.retriever or models.retriever)
    set_margin(state, MG.price(gap, n, setup.margin_fraction, "bank seed successes"), log)


def seed_gap(
    setup: StepSetup, models: StepModels, rows: list[MG.PricingTrajectory], retriever: Retriever
) -> tuple[float, int]:
    """The mean over `rows` (every rank's share of them) of each one's mean log p_T,φ0(a) − log p_S(a) at its
    action tokens, and how many rows had action tokens; no gradient, in micro-batches of the run's size. Rows
    too long to hold the teacher's splice within rollout.max_context are left out (the bank's rollouts did not
    reserve room for it)."""
    rows = [r for r in rows if len(r.token_ids) + setup.splice_room <= setup.max_context]
    part = rows[D.shard_range(len(rows)).start : D.shard_range(len(rows)).stop]
    total, n = 0.0, 0
    if part:
        experiences = retriever([r.task for r in part])
        queries = models.queries_of([r.task for r in part])
        latents = [x.to(models.device) for x in models.anchor(experiences, queries)]  # φ0's, cached
        keys = [(queries[i] if queries else "", *experiences[i]) for i in range(len(part))]  # equal keys: equal latents
        ids, masks = [r.token_ids for r in part], [r.action_mask for r in part]
        with torch.no_grad():
            for chunk in micro_batches([len(i) for i in ids], setup.micro_batch):
                sums, counts = _chunk_gaps(
                    setup,
                    models,
                    [ids[i] for i in chunk],
                    [masks[i] for i in chunk],
                    [latents[i] for i in chunk],
                    keys=[keys[i] for i in chunk],
                )
                total += float((sums / counts.clamp(min=1))[counts > 0].sum())
                n += int((counts > 0).sum())
    total, n = D.global_sum([total, n])
    return (total / n if n else math.nan), int(n)


def _chunk_gaps(
    setup: StepSetup, models: StepModels, ids, masks, latents, *, keys
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a chunk: Σ over its action tokens of log p_T,φ0(a) − log p_S(a), and its action tokens."""
    with models.teacher_lm(setup.method.teacher.weights) as lm:
        scores = S.score_teacher(
            lm,
            ids,
            masks,
            latents,
            keys,
            framing=models.framing,
            share_prompt=setup.share_prompt,
            top_k=setup.top_k,
            temperature=setup.method.teacher.temperature,
        )
    sbatch = build_batch(models.student, ids, masks)
    s_lp = torch.log_softmax(action_logits(models.student, sbatch), dim=-1)  # (n, V)
    if not torch.equal(sbatch.action_ids, scores.action_ids):
        raise RuntimeError("margin pricing: teacher and student disagree on the action tokens")
    gap = scores.action_logprobs - s_lp.gather(-1, sbatch.action_ids[:, None]).squeeze(-1)  # (n,)
    sums = torch.zeros(len(ids), device=gap.device).index_add_(0, scores.token_traj_index, gap.float())
    return sums, torch.bincount(scores.token_traj_index, minlength=len(ids))


def price_on_batch(setup: StepSetup, state: DistillState, batch: RolloutBatch, gap_sums: torch.Tensor, log) -> None:
    """`lopd.margin: auto` with nothing stored to price on: this step's successes (the first step's, whose
    teacher pass ran with φ0's latents against the initial student, the same gap as on stored ones).
    `gap_sums` (B,): per trajectory, Σ over its action tokens of log p_T,φ − log p_S,old."""
    if not setup.method.needs_composer or not setup.teacher_pass:
        no_latent_teacher(setup, state, log)
        return
    counts = torch.tensor(D.gather_lists(batch.token_counts.tolist()))
    gaps = torch.tensor(D.gather_lists((gap_sums.cpu() / batch.token_counts.clamp(min=1)).tolist()))
    successes = torch.tensor(D.gather_lists(batch.successes.tolist()), dtype=torch.bool)
    gap, n = MG.mean_over_successes(gaps, counts, successes)
    set_margin(state, MG.price(gap, n, setup.margin_fraction, f"step {state.step + 1} successes"), log)


def no_latent_teacher(setup: StepSetup, state: DistillState, log) -> None:
    """A method without latents has no teacher advantage to price: m = 0."""
    set_margin(
        state,
        MG.price(math.nan, 0, setup.margin_fraction, "none"),
        log,
        f"distill: margin: auto: lopd.method={setup.method.name!r} has no latent teacher to price m on; m = 0",
    )


def set_margin(state: DistillState, priced: MG.PricedMargin, log, message: str | None = None) -> None:
    state.margin, state.margin_pricing = priced.margin, priced.summary()
    log(message or priced.message())

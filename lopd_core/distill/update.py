"""Steps 2-5 of one LOPD step on a batch of trajectories, the optimised way (`Distiller.update`).

The batch is processed in chunks of `lopd.micro_batch` trajectories (0 = one chunk): per chunk, the teacher
forward (graph to the latents), the student forward and backward, then the composer's chunk loss backward
through the teacher, after which both graphs are gone. Gradients accumulate; the student optimizer steps only
after every chunk, then the composer (after its own backward through the resampler), then β — the order of
DESIGN §3. Every chunk's sum is divided by a whole-batch count known up front (step.py), so the accumulated
gradients, δ̄, the KL and the entropies equal the whole-batch ones (up to float summation order). The
composer's s_old is the student's detached logits of the same chunk, taken before any optimizer step, so it is
the pre-update student, as specified.

Steps 2 and 4 share one teacher forward: it is run with the composer's graph attached, step 2 takes a detached
copy of what it needs and step 4 back-propagates through the same activations afterwards (the composer has not
changed in between, so this is exactly the specified order, one teacher pass cheaper).

loss_φ = KL + β·(m − δ̄) + λ·anchor is linear in its three terms, so it is back-propagated in pieces, each
through `losses.composer_loss`: each chunk's shares of KL and δ̄ (with m = 0 and no anchor), then, once, the
anchor with m (whose β·m has no gradient). The pieces add up to the whole-batch loss_φ and its gradient.
reference.py is the same update read top to bottom, and tests/distill/test_reference_update.py holds the two equal.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.distill import baselines as B
from lopd_core.distill import losses as L
from lopd_core.distill import step as S
from lopd_core.distill.dashboard import ComposerStep, step_result
from lopd_core.distill.reading import reading_kl, reading_rows
from lopd_core.distill.teacher import action_logits, build_batch
from lopd_core.distill.teacher_context import (
    TeacherContext,
    check_teacher_rows,
    row_latents,
    rows_context,
    teacher_context,
    teacher_lm,
)
from lopd_core.envs import Task

if TYPE_CHECKING:
    from lopd_core.distill.trainer import Distiller


@contextmanager
def timed(sums: S.StepSums, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        sums.seconds[phase] += time.perf_counter() - started


def grad_norm(params, max_norm: float) -> float:
    return float(SH.full_value(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)))


def update(d: Distiller, tasks: list[Task], trajs: list, *, started: float) -> S.UpdateResult:
    """Steps 2-5 on `trajs` (samples_per_task each per task, in task order), in the order of DESIGN §3."""
    t_update = time.perf_counter()
    batch = S.rollout_batch(
        trajs,
        samples_per_task=d.cfg.samples_per_task,
        advantage=d.cfg.advantage,
        group_std_eps=d.params.baselines.group_std_eps if d.student_loss.needs_pg_advantage else None,
        device=d.composer.queries.device,
    )
    sums = S.StepSums.zeros(len(batch), batch.advantage.device)
    with timed(sums, "teacher"):
        context = teacher_context(d, tasks, trajs, batch)  # 2a. latents once per distinct experience
    beta = d.state.beta  # the β of this step's composer loss (the row's `beta`)

    chunks = d._chunks(batch.token_ids)
    picked = d._composer_chunks(len(chunks))
    scale = S.composer_scale(batch, chunks, picked)
    d.opt_theta.zero_grad(set_to_none=True)
    for c, chunk in enumerate(chunks):  # 2-4 on each micro-batch, gradients accumulated
        run_chunk(d, batch, context, chunk, sums, beta=beta, scale=scale, train_composer=c in picked)
    kl_text = reading_backward(d, batch, context, sums)  # 4'. the reading term, into the latents' gradient
    totals = sums.reduced()
    if d.margin is None:  # `lopd.margin: auto` with nothing stored to price on: this step's successes
        d.price_on_batch(batch, sums)

    with timed(sums, "student"):
        grad_theta = step_student(d, totals["distill"])  # 3. once, on the accumulated gradient
    with timed(sums, "composer"):
        composer = step_composer(d, context, totals, beta, kl_text)  # 4. anchor + latents' gradient, one backward
    delta_bar = totals["delta"]
    if d.method.composer.trainable and math.isfinite(delta_bar):  # 5. β only acts on a composer that learns
        d.state.beta = L.dual_ascent(beta, margin=d.margin, delta_bar=delta_bar, lr=d.cfg.beta_lr)
    d.state.step += 1
    return step_result(
        d,
        batch,
        sums,
        totals,
        beta=beta,
        grad_theta=grad_theta,
        composer=composer,
        started=started,
        rollout_s=t_update - started,
        trajectories=trajs,
    )


# ---- steps 2-4 on a chunk -------------------------------------------------------------------------------------


def run_chunk(
    d: Distiller,
    batch: S.RolloutBatch,
    context: TeacherContext,
    chunk: list[int],
    sums: S.StepSums,
    *,
    beta: float,
    scale: S.ComposerScale,
    train_composer: bool,
) -> None:
    """Steps 2-4 on one chunk, gradients accumulated. A function so that every tensor of the chunk (logits,
    log-probs, padded inputs) is released when it returns, before the next chunk starts."""
    with timed(sums, "student"):
        sbatch = build_batch(d.student, *batch.rows(chunk))
    graph = d.method.needs_composer and d.method.composer.trainable and train_composer
    if not d.teacher_pass:  # GRPO without a reference KL: the student alone
        with timed(sums, "student"):
            student_backward(d, batch, context, chunk, sbatch, None, sums, keep_old=True)
    elif d.low_memory:
        chunk_low_memory(d, batch, context, chunk, sbatch, sums, beta=beta, scale=scale, graph=graph)
    else:
        with timed(sums, "teacher"):
            scores = score_rows(d, batch, context, chunk, sums, graph=graph)
        with timed(sums, "student"):
            targets = scores.targets(keep_logits=d.student_loss.reads_teacher_logits)
            s_old = student_backward(d, batch, context, chunk, sbatch, targets, sums, keep_old=True)
        with timed(sums, "composer"):
            composer_backward(d, batch, chunk, scores, s_old, sums, beta=beta, scale=scale)


def chunk_low_memory(d: Distiller, batch, context, chunk, sbatch, sums, *, beta, scale, graph) -> None:
    """The low-memory order (`lopd.low_memory`): s_old from a no-grad student forward first, so each teacher
    pass (`lopd.teacher_micro_batch` consecutive rows; 0 = the whole chunk) is consumed by the composer's
    backward before the next, and the student's graph is built only after the last. Peak memory is the
    larger of the two graphs rather than both, for one more student forward per chunk (and one more
    resampler forward, `teacher_context`). The chunk's action tokens are ordered row by row, so a pass's
    tokens are a contiguous slice of the student's."""
    with timed(sums, "student"), torch.no_grad():
        s_lp_old = torch.log_softmax(action_logits(d.student, sbatch), dim=-1)  # (n, V)
    size = d.cfg.teacher_micro_batch or len(chunk)
    targets, offset = [], 0
    for k in range(0, len(chunk), size):
        part = chunk[k : k + size]
        with timed(sums, "teacher"):
            scores = score_rows(d, batch, context, part, sums, graph=graph)
        n = scores.action_ids.shape[0]
        with timed(sums, "composer"):
            part_lp_old = s_lp_old[offset : offset + n]  # (n, V) this pass's tokens
            sums.add_student_entropy(part_lp_old)
            s_old = S.StudentOld.of(part_lp_old, scores.topk_ids, scores.action_ids)
            composer_backward(d, batch, part, scores, s_old, sums, beta=beta, scale=scale)
        offset += n
        targets.append(scores.targets(keep_logits=d.student_loss.reads_teacher_logits))
        del scores  # its graph is consumed: not alive through the next pass
    if offset != sbatch.action_ids.shape[0]:
        raise RuntimeError("teacher passes and the student chunk disagree on the action tokens")
    del s_lp_old  # the composer is done with it: not alive through the student's backward
    with timed(sums, "student"):
        student_backward(d, batch, context, chunk, sbatch, S.StudentTargets.cat(targets), sums, keep_old=False)


def score_rows(
    d: Distiller, batch: S.RolloutBatch, context: TeacherContext, rows: list[int], sums: S.StepSums, *, graph: bool
) -> S.TeacherScores:
    """Step 2 on `rows` with this method's teacher weights and context; the graph to the latents is kept
    when `graph` (for step 4). The baselines' teachers read text or nothing in the same slot."""
    ids, masks = batch.rows(rows)
    with teacher_lm(d) as lm, nullcontext() if graph else torch.no_grad():
        ctx, keys = rows_context(d, lm, context, ids, rows)
        check_teacher_rows(d, ids, ctx)
        scores = S.score_teacher(
            lm,
            ids,
            masks,
            ctx,
            keys,
            framing=d.framing,
            share_prompt=d.cfg.share_prompt,
            top_k=d.cfg.top_k,
            temperature=d.method.teacher.temperature,
            keep_logits=d.student_loss.reads_teacher_logits,
        )
    sums.add_teacher(scores)
    return scores


def student_backward(
    d: Distiller,
    batch: S.RolloutBatch,
    context: TeacherContext,
    chunk: list[int],
    sbatch,
    targets: S.StudentTargets | None,
    sums: S.StepSums,
    *,
    keep_old: bool,
):
    """Step 3 on a chunk: forward, loss (its share of the batch's token mean), backward. With `keep_old` (the
    low-memory order took them earlier), adds the pre-update student's entropy to the sums and returns its
    detached log-probs where the composer's loss reads them (on the teacher's top-k ids; None without a
    teacher), so no (n, V) tensor outlives this call."""
    device = sbatch.action_ids.device
    s_logits = action_logits(d.student, sbatch)  # (n, V)
    rows = torch.tensor(chunk, dtype=torch.long, device=device)[sbatch.token_traj_index]  # (n,) trajectory
    per_token = S.student_token_loss(
        s_logits,
        sbatch.action_ids,
        targets,
        d.student_loss,
        pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
        sample_logprobs=(batch.action_sample_logprobs(chunk, device) if d.student_loss.reads_sample_logprobs else None),
    )
    if context.signal is not None:
        per_token = per_token * context.signal[rows]
    share = per_token.sum() / context.n_signal
    share.backward()
    sums.shares["distill"] += float(share.detach())
    if not keep_old:
        return None
    s_lp_old = torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V), freed on return
    sums.add_student_entropy(s_lp_old)
    return None if targets is None else S.StudentOld.of(s_lp_old, targets.topk_ids, sbatch.action_ids)


def composer_backward(
    d: Distiller,
    batch: S.RolloutBatch,
    rows: list[int],
    scores: S.TeacherScores,
    s_old: S.StudentOld,
    sums: S.StepSums,
    *,
    beta: float,
    scale: S.ComposerScale,
) -> None:
    """Step 4 on the rows of one teacher pass: this pass's piece of loss_φ — its shares of KL(sg[p_S,old] ‖
    p_T,φ) and δ̄ (module docstring) — backward through the frozen teacher to the latent leaf; the teacher's
    graph is gone afterwards. Only passes that kept a graph (chunks picked for the composer) back-propagate,
    rescaled to the batch."""
    rows_t = torch.tensor(rows, dtype=torch.long, device=scores.action_ids.device)
    terms = S.composer_terms(scores, s_old, batch.advantage[rows_t])
    kl_share = terms.kl_tokens.sum() / batch.n_tokens
    delta_share = terms.delta.sum() / batch.n_scored  # δ̄ = Σ_τ δ(τ) / trajectories
    if kl_share.requires_grad:
        L.composer_loss(
            scale.kl * kl_share, scale.delta * delta_share, beta=beta, margin=0.0, anchor=0.0, anchor_weight=0.0
        ).backward()
    sums.add_composer(terms, rows_t[scores.token_traj_index], float(kl_share.detach()), float(delta_share.detach()))


# ---- the optimizer steps ----------------------------------------------------------------------------------------


def step_student(d: Distiller, distill_loss: float) -> float:
    """The student's optimizer step on the accumulated gradient (summed over ranks: identical steps
    everywhere); returns the gradient norm before clipping."""
    if d.sharding.active:  # FSDP's reduce-scatter, into the sharded gradients (sharding.py)
        d.sharding.reduce_gradients(d.student)
    else:
        D.sum_gradients(d.trainable.parameters())
    with d.sharding.student_sharded():
        grad = grad_norm(d.trainable.parameters(), d.cfg.max_grad_norm)
        if math.isfinite(distill_loss) and math.isfinite(grad):
            d.opt_theta.step()
            if d.ema_lm is not None:  # SDPO's EMA teacher follows the student
                B.update_ema(d.ema_lm, d.student, d.params.baselines.ema_decay)
        else:
            d.state.skipped_updates += 1
            d.log(f"distill: step {d.state.step + 1}: non-finite student loss/gradient, update skipped")
    return grad


def composer_anchor_backward(d: Distiller, context: TeacherContext, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor's piece of loss_φ (with m) and the latents' accumulated gradient, one backward through the
    resampler. Returns the step's latents (Σ J_τ·K, D) and this rank's share of the anchor, detached."""
    width = d.composer.proj_out.out_features
    order = [s for ss in context.slots for s in ss]  # per trajectory, as the teacher read them
    anchor_share = len(order) / max(D.global_sum([len(order)])[0], 1)  # this rank's rows of the anchor's mean
    # low memory: the same forward again (φ unchanged, deterministic), now with a graph
    composed = context.composed if context.composed is not None else d.composer(*context.encoded)
    flat = composed[order].reshape(-1, width)
    anchor_u = d.anchor_latents([[t] for t in context.texts], context.queries)  # φ0's (K, D) per distinct row
    anchor_target = torch.stack(anchor_u)[order].reshape(-1, width).to(flat.device)
    anchor = anchor_share * L.anchor_loss(flat, anchor_target)
    zero = torch.zeros((), device=flat.device)
    piece = L.composer_loss(
        zero, zero, beta=beta, margin=d.margin, anchor=anchor, anchor_weight=d.method.composer.anchor_weight
    )
    tensors, grads = [piece], [None]
    if context.latents.grad is not None:
        tensors.append(composed)
        grads.append(context.latents.grad)
    torch.autograd.backward(tensors, grads)
    return flat.detach(), anchor.detach()


def step_composer(
    d: Distiller, context: TeacherContext, totals: dict[str, float], beta: float, kl_text: float = 0.0
) -> ComposerStep:
    """The composer's step: the anchor's piece plus the latents' accumulated gradient, one backward through
    the resampler, then the optimizer step (skipped when non-finite)."""
    width = d.composer.proj_out.out_features
    flat = torch.zeros((0, width), device=d.composer.queries.device)  # (Σ J_τ·K, D) the step's latents
    anchor = torch.zeros(())
    d.opt_phi.zero_grad(set_to_none=True)
    if context.latents is not None and d.method.composer.trainable:  # (φ = φ0: frozen-composer ablation)
        flat, anchor = composer_anchor_backward(d, context, beta)
    elif context.latents is not None:  # φ = φ0: nothing to learn, but the dashboard still shows their scale
        flat = context.latents[[s for ss in context.slots for s in ss]].reshape(-1, width).detach()
    anchor_v = D.global_sum([float(anchor)])[0]
    D.sum_gradients(d.composer.parameters())
    loss_phi = (
        float(
            L.composer_loss(
                torch.tensor(totals["kl"]),
                torch.tensor(totals["delta"]),
                beta=beta,
                margin=d.margin,
                anchor=anchor_v,
                anchor_weight=d.method.composer.anchor_weight,
            )
        )
        + d.cfg.text_kl_weight * kl_text
    )
    grad = grad_norm(d.composer.parameters(), d.cfg.max_grad_norm)
    if math.isfinite(loss_phi) and math.isfinite(grad):
        d.opt_phi.step()
    else:
        d.state.skipped_updates += 1
        d.log(f"distill: step {d.state.step + 1}: non-finite composer loss/gradient, update skipped")
    norm_sum, norm_rows = D.global_sum([float(flat.norm(dim=-1).sum()), flat.shape[0]])
    return ComposerStep(anchor_v, grad, norm_sum / norm_rows if norm_rows else 0.0, kl_text)


def reading_backward(d: Distiller, batch: S.RolloutBatch, context: TeacherContext, sums: S.StepSums) -> float:
    """The composer's reading term (reading.py): w · KL(p_text ‖ p_latent) on a few of the step's rows, backward
    into the latents' leaf, whose gradient step_composer then pushes through the resampler with the rest of
    loss_φ. Returns the KL (a token mean over every rank's rows); 0 where φ does not train or w is 0."""
    if not (d.cfg.text_kl_weight and d.method.composer.trainable and context.latents is not None):
        return 0.0
    with timed(sums, "composer"):
        rows = reading_rows(len(batch), d.cfg.samples_per_task, d.cfg.text_kl_rows)
        ids, masks = batch.rows(rows)
        texts = [[context.texts[j] for j in context.slots[i]] for i in rows]
        with teacher_lm(d) as lm:
            latents = [row_latents(d, context, i) for i in rows]
            kl_sum, n = reading_kl(
                lm, d.tokenizer, d.framing, ids, masks, latents, texts, max_context=d.params.rollout.max_context
            )
            total_sum, total_n = D.global_sum([float(kl_sum.detach()), n])
            if kl_sum.requires_grad:
                (d.cfg.text_kl_weight * kl_sum / max(total_n, 1)).backward()
    return total_sum / max(total_n, 1)

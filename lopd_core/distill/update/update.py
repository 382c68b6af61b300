"""Steps 2-5 of one LOPD step, the optimised way: reference.py's update (read that first) with the optimisations
below and nothing else (tests/distill/test_reference_update.py holds the two equal for every method); the trainer
runs it wherever the settings ask for one of them, reference.py's where none is (`StepSetup.runs_reference`).

  1. Micro-batches (`lopd.micro_batch`): per chunk the teacher forward, the student forward and backward, then the
     composer's chunk loss backward through the teacher, after which both graphs are gone. Every chunk's sum is
     divided by a whole-batch count known up front (step.py), so the accumulated gradients, δ̄, the KL and the
     entropies equal the whole-batch ones (up to float summation order). θ steps only after every chunk, then φ,
     then β — the order of DESIGN §3.
  2. One teacher pass for steps 2 and 4: run with the composer's graph attached, step 2 takes a detached copy and
     step 4 back-propagates through the same activations afterwards (φ has not changed in between: exactly the
     specified order, one teacher pass cheaper). s_old is the chunk's student logits before any optimizer step.
  3. A task's prompt shared by its samples (`lopd.share_prompt`, prefix.py): its prompt and latents read once.
  4. Latents composed once per distinct experience text (teacher_context.py); the chunks' gradients gather on a
     detached leaf and are pushed through the resampler once, after the last chunk.
  5. loss_φ = KL + β·(m − δ̄) + λ·anchor (+ the reading term) back-propagated in pieces through
     `losses.composer_loss`: each chunk's shares of KL and δ̄ (m = 0, no anchor), then once the anchor with m. It
     is linear in its terms, so the pieces add up to the whole-batch loss_φ and its gradient.
  6. The low-memory order (`lopd.low_memory`, `lopd.teacher_micro_batch`: `chunk_low_memory`).
  7. A share of the chunks training φ (`lopd.composer_fraction`), rescaled to the batch (batch.py).
  8. Several processes: sums and gradients reduced over ranks; FSDP2's sharded student (sharding.py).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.distill.composer.reading import reading_kl, reading_rows
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.teacher import ScoringBatch, action_logits, build_batch
from lopd_core.distill.teacher import baselines as B
from lopd_core.distill.update import margin_pricing as P
from lopd_core.distill.update import step as S
from lopd_core.distill.update.batch import (
    ComposerScale,
    RolloutBatch,
    chunk_group,
    composer_chunks,
    composer_scale,
    micro_batches,
)
from lopd_core.distill.update.dashboard import ComposerStep, UpdateResult, step_result
from lopd_core.distill.update.inputs import StepModels, StepSetup
from lopd_core.distill.update.state import DistillState
from lopd_core.distill.update.teacher_context import (
    TeacherContext,
    check_teacher_rows,
    row_latents,
    rows_context,
    teacher_context,
)
from lopd_core.envs import Task


@contextmanager
def timed(sums: S.StepSums, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        sums.seconds[phase] += time.perf_counter() - started


@dataclass(frozen=True)
class UpdateParts:
    """What every function of one update reads, fixed for the update (the weights and the sums change, not which
    they are): each function below takes this and what is its own (a chunk's rows, a pass's scores)."""

    setup: StepSetup
    models: StepModels
    batch: RolloutBatch
    context: TeacherContext
    sums: S.StepSums


def grad_norm(params, max_norm: float) -> float:
    return float(SH.full_value(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)))


def update(
    setup: StepSetup, models: StepModels, state: DistillState, tasks: list[Task], trajs: list, *, started: float, log
) -> UpdateResult:
    """Steps 2-5 on `trajs` (samples_per_task each per task, in task order), in the order of DESIGN §3."""
    t_update = time.perf_counter()
    batch = setup.rollout_batch(state, trajs, models.device)
    sums = S.StepSums.zeros(len(batch), batch.advantage.device)
    with timed(sums, "teacher"):
        context = teacher_context(setup, models, tasks, trajs, batch)  # 2a. latents once per distinct experience
    beta = state.beta  # the β of this step's composer loss (the row's `beta`)
    parts = UpdateParts(setup, models, batch, context, sums)

    chunks = step_chunks(setup, batch.token_ids)
    picked = composer_picks(setup, len(chunks), state.step)
    scale = composer_scale(batch, chunks, picked)
    models.opt_theta.zero_grad(set_to_none=True)
    for c, chunk in enumerate(chunks):  # 2-4 on each micro-batch, gradients accumulated
        run_chunk(parts, chunk, beta=beta, scale=scale, train_composer=c in picked)
    kl_text = reading_backward(parts)  # 4'. the reading term, into the latents' grad
    totals = sums.reduced()
    if setup.margin(state) is None:  # `lopd.margin: auto` with nothing stored to price on: this step's successes
        P.price_on_batch(setup, state, batch, sums.gap, log)
    margin = setup.margin(state)

    with timed(sums, "student"):
        grad_theta = step_student(setup, models, state, totals["distill"], log)  # 3. once, on the accumulated grad
    with timed(sums, "composer"):
        composer = step_composer(parts, state, totals, beta=beta, margin=margin, kl_text=kl_text, log=log)  # 4.
    delta_bar = totals["delta"]
    if setup.method.composer.trainable and math.isfinite(delta_bar):  # 5. β only acts on a composer that learns
        state.beta = L.dual_ascent(beta, margin=margin, delta_bar=delta_bar, lr=setup.beta_lr)
    state.step += 1
    return step_result(
        setup,
        models,
        state,
        batch,
        sums,
        totals=totals,
        beta=beta,
        grad_theta=grad_theta,
        composer=composer,
        started=started,
        rollout_s=t_update - started,
        trajectories=trajs,
    )


def step_chunks(setup: StepSetup, token_ids: list[list[int]]) -> list[list[int]]:
    """The rows of each micro-batch (`lopd.micro_batch`; a task's samples together where they share a prompt)."""
    group = chunk_group(setup.samples_per_task, setup.share_prompt)
    return micro_batches([len(i) for i in token_ids], setup.micro_batch, group)


def composer_picks(setup: StepSetup, n_chunks: int, step: int) -> set[int]:
    """Which chunks train the composer this step (`lopd.composer_fraction`), seeded by (seed, step)."""
    return composer_chunks(n_chunks, setup.composer_fraction, setup.seed * 1_000_003 + step)


# ---- steps 2-4 on a chunk -------------------------------------------------------------------------------------


def run_chunk(parts: UpdateParts, chunk: list[int], *, beta: float, scale: ComposerScale, train_composer: bool) -> None:
    """Steps 2-4 on one chunk, gradients accumulated. A function so that every tensor of the chunk (logits,
    log-probs, padded inputs) is released when it returns, before the next chunk starts."""
    setup, batch, sums = parts.setup, parts.batch, parts.sums
    with timed(sums, "student"):
        sbatch = build_batch(parts.models.student, *batch.rows(chunk))
    graph = setup.method.needs_composer and setup.method.composer.trainable and train_composer
    if not setup.teacher_pass:  # GRPO without a reference KL: the student alone
        with timed(sums, "student"):
            student_backward_keeping_old(parts, chunk, sbatch, None)
    elif setup.low_memory:
        chunk_low_memory(parts, chunk, sbatch, beta=beta, scale=scale, graph=graph)
    else:
        with timed(sums, "teacher"):
            scores = score_rows(parts, chunk, graph=graph)
        with timed(sums, "student"):
            targets = scores.targets(keep_logits=setup.student_loss.reads_teacher_logits)
            s_old = student_backward_keeping_old(parts, chunk, sbatch, targets)
        with timed(sums, "composer"):
            composer_backward(batch, chunk, scores, s_old, sums, beta=beta, scale=scale)


def chunk_low_memory(
    parts: UpdateParts, chunk: list[int], sbatch: ScoringBatch, *, beta: float, scale: ComposerScale, graph: bool
) -> None:
    """The low-memory order (`lopd.low_memory`): s_old from a no-grad student forward first, so each teacher
    pass (`lopd.teacher_micro_batch` consecutive rows; 0 = the whole chunk) is consumed by the composer's
    backward before the next, and the student's graph is built only after the last. Peak memory is the
    larger of the two graphs rather than both, for one more student forward per chunk (and one more
    resampler forward, `teacher_context`). The chunk's action tokens are ordered row by row, so a pass's
    tokens are a contiguous slice of the student's."""
    setup, models, batch, sums = parts.setup, parts.models, parts.batch, parts.sums
    with timed(sums, "student"), torch.no_grad():
        s_lp_old = torch.log_softmax(action_logits(models.student, sbatch), dim=-1)  # (n, V)
    size = setup.teacher_micro_batch or len(chunk)
    targets, offset = [], 0
    for k in range(0, len(chunk), size):
        part = chunk[k : k + size]
        with timed(sums, "teacher"):
            scores = score_rows(parts, part, graph=graph)
        n = scores.action_ids.shape[0]
        with timed(sums, "composer"):
            part_lp_old = s_lp_old[offset : offset + n]  # (n, V) this pass's tokens
            sums.add_student_entropy(part_lp_old)
            s_old = S.StudentOld.of(part_lp_old, scores.topk_ids, scores.action_ids)
            composer_backward(batch, part, scores, s_old, sums, beta=beta, scale=scale)
        offset += n
        targets.append(scores.targets(keep_logits=setup.student_loss.reads_teacher_logits))
        del scores  # its graph is consumed: not alive through the next pass
    if offset != sbatch.action_ids.shape[0]:
        raise RuntimeError("teacher passes and the student chunk disagree on the action tokens")
    del s_lp_old  # the composer is done with it: not alive through the student's backward
    with timed(sums, "student"):
        student_backward(parts, chunk, sbatch, S.StudentTargets.cat(targets))


def score_rows(parts: UpdateParts, rows: list[int], *, graph: bool) -> S.TeacherScores:
    """Step 2 on `rows` with this method's teacher weights and context; the graph to the latents is kept
    when `graph` (for step 4). The baselines' teachers read text or nothing in the same slot."""
    setup, models = parts.setup, parts.models
    ids, masks = parts.batch.rows(rows)
    with models.teacher_lm(setup.method.teacher.weights) as lm, nullcontext() if graph else torch.no_grad():
        ctx, keys = rows_context(setup, models, lm, parts.context, ids, rows=rows)
        check_teacher_rows(setup, ids, ctx)
        scores = S.score_teacher(
            lm,
            ids,
            masks,
            ctx,
            keys,
            framing=models.framing,
            share_prompt=setup.share_prompt,
            top_k=setup.top_k,
            temperature=setup.method.teacher.temperature,
            keep_logits=setup.student_loss.reads_teacher_logits,
        )
    parts.sums.add_teacher(scores)
    return scores


def student_backward(
    parts: UpdateParts, chunk: list[int], sbatch: ScoringBatch, targets: S.StudentTargets | None
) -> torch.Tensor:
    """Step 3 on a chunk: forward, loss (its share of the batch's token mean), backward. Returns the student's
    (n, V) logits, detached (the low-memory order, which took s_old before, lets them go at once)."""
    setup, models, batch, context, sums = parts.setup, parts.models, parts.batch, parts.context, parts.sums
    device = sbatch.action_ids.device
    s_logits = action_logits(models.student, sbatch)  # (n, V)
    rows = torch.tensor(chunk, dtype=torch.long, device=device)[sbatch.token_traj_index]  # (n,) trajectory
    loss = setup.student_loss
    per_token = S.student_token_loss(
        s_logits,
        sbatch.action_ids,
        targets,
        loss,
        pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
        distill_weight=None if batch.distill_weight is None else batch.distill_weight[rows],
        sample_logprobs=(batch.action_sample_logprobs(chunk, device) if loss.reads_sample_logprobs else None),
    )
    if context.signal is not None:
        per_token = per_token * context.signal[rows]
    share = per_token.sum() / context.n_signal
    share.backward()
    sums.shares["distill"] += float(share.detach())
    return s_logits.detach()


def student_backward_keeping_old(
    parts: UpdateParts, chunk: list[int], sbatch: ScoringBatch, targets: S.StudentTargets | None
) -> S.StudentOld | None:
    """`student_backward`, then the pre-update student's entropy into the sums and its detached log-probs on the
    teacher's top-k ids for the composer's loss (None without a teacher): no (n, V) tensor outlives this call."""
    s_lp_old = torch.log_softmax(student_backward(parts, chunk, sbatch, targets), dim=-1)  # (n, V), freed on return
    parts.sums.add_student_entropy(s_lp_old)
    return None if targets is None else S.StudentOld.of(s_lp_old, targets.topk_ids, sbatch.action_ids)


def composer_backward(
    batch: RolloutBatch,
    rows: list[int],
    scores: S.TeacherScores,
    s_old: S.StudentOld,
    sums: S.StepSums,
    *,
    beta: float,
    scale: ComposerScale,
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


def step_student(setup: StepSetup, models: StepModels, state: DistillState, distill_loss: float, log) -> float:
    """The student's optimizer step on the accumulated gradient (summed over ranks: identical steps
    everywhere); returns the gradient norm before clipping."""
    if models.sharding.active:  # FSDP's reduce-scatter, into the sharded gradients (sharding.py)
        models.sharding.reduce_gradients(models.student)
    else:
        D.sum_gradients(models.trainable.parameters())
    with models.sharding.student_sharded():
        grad = grad_norm(models.trainable.parameters(), setup.max_grad_norm)
        if math.isfinite(distill_loss) and math.isfinite(grad):
            models.opt_theta.step()
            if models.ema is not None:  # SDPO's EMA teacher follows the student
                B.update_ema(models.ema, models.student, setup.ema_decay)
        else:
            state.skipped_updates += 1
            log(f"distill: step {state.step + 1}: non-finite student loss/gradient, update skipped")
    return grad


def composer_anchor_backward(parts: UpdateParts, *, beta: float, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor's piece of loss_φ (with m) and the latents' accumulated gradient, one backward through the
    resampler. Returns the step's latents (Σ J_τ·K, D) and this rank's share of the anchor, detached."""
    setup, models, context = parts.setup, parts.models, parts.context
    width = models.latent_width
    order = [s for ss in context.slots for s in ss]  # per trajectory, as the teacher read them
    anchor_share = len(order) / max(D.global_sum([len(order)])[0], 1)  # this rank's rows of the anchor's mean
    # low memory: the same forward again (φ unchanged, deterministic), now with a graph
    composed = context.composed if context.composed is not None else models.composer(*context.encoded)
    flat = composed[order].reshape(-1, width)
    anchor_u = models.anchor([[t] for t in context.texts], context.queries)  # φ0's (K, D) per distinct row
    anchor_target = torch.stack(anchor_u)[order].reshape(-1, width).to(flat.device)
    anchor = anchor_share * L.anchor_loss(flat, anchor_target)
    zero = torch.zeros((), device=flat.device)
    weight = setup.method.composer.anchor_weight
    piece = L.composer_loss(zero, zero, beta=beta, margin=margin, anchor=anchor, anchor_weight=weight)
    tensors, grads = [piece], [None]
    if context.latents.grad is not None:
        tensors.append(composed)
        grads.append(context.latents.grad)
    torch.autograd.backward(tensors, grads)
    return flat.detach(), anchor.detach()


def step_composer(
    parts: UpdateParts,
    state: DistillState,
    totals: dict[str, float],
    *,
    beta: float,
    margin: float,
    kl_text: float,
    log,
) -> ComposerStep:
    """The composer's step: the anchor's piece plus the latents' accumulated gradient, one backward through
    the resampler, then the optimizer step (skipped when non-finite)."""
    setup, models, context = parts.setup, parts.models, parts.context
    width = models.latent_width
    flat = torch.zeros((0, width), device=models.device)  # (Σ J_τ·K, D) the step's latents
    anchor = torch.zeros(())
    models.opt_phi.zero_grad(set_to_none=True)
    if context.latents is not None and setup.method.composer.trainable:  # (φ = φ0: frozen-composer ablation)
        flat, anchor = composer_anchor_backward(parts, beta=beta, margin=margin)
    elif context.latents is not None:  # φ = φ0: nothing to learn, but the dashboard still shows their scale
        flat = context.latents[[s for ss in context.slots for s in ss]].reshape(-1, width).detach()
    anchor_v = D.global_sum([float(anchor)])[0]
    D.sum_gradients(models.composer.parameters())
    kl, delta = torch.tensor(totals["kl"]), torch.tensor(totals["delta"])
    weight = setup.method.composer.anchor_weight
    loss_phi = float(L.composer_loss(kl, delta, beta=beta, margin=margin, anchor=anchor_v, anchor_weight=weight))
    loss_phi += setup.text_kl_weight * kl_text
    grad = grad_norm(models.composer.parameters(), setup.max_grad_norm)
    if math.isfinite(loss_phi) and math.isfinite(grad):
        models.opt_phi.step()
    else:
        state.skipped_updates += 1
        log(f"distill: step {state.step + 1}: non-finite composer loss/gradient, update skipped")
    norm_sum, norm_rows = D.global_sum([float(flat.norm(dim=-1).sum()), flat.shape[0]])
    return ComposerStep(anchor_v, grad, norm_sum / norm_rows if norm_rows else 0.0, kl_text)


def reading_backward(parts: UpdateParts) -> float:
    """The composer's reading term (reading.py): w · KL(p_text ‖ p_latent) on a few of the step's rows, backward
    into the latents' leaf, whose gradient step_composer then pushes through the resampler with the rest of
    loss_φ. Returns the KL (a token mean over every rank's rows); 0 where φ does not train or w is 0."""
    setup, models, batch, context, sums = parts.setup, parts.models, parts.batch, parts.context, parts.sums
    if not (setup.text_kl_weight and setup.method.composer.trainable and context.latents is not None):
        return 0.0
    with timed(sums, "composer"):
        rows = reading_rows(len(batch), setup.samples_per_task, setup.text_kl_rows)
        ids, masks = batch.rows(rows)
        texts = [[context.texts[j] for j in context.slots[i]] for i in rows]
        with models.teacher_lm(setup.method.teacher.weights) as lm:
            latents = [row_latents(models, context, i) for i in rows]
            kl_sum, n = reading_kl(
                lm,
                ids,
                masks,
                latents,
                texts,
                tokenizer=models.tokenizer,
                framing=models.framing,
                max_context=setup.max_context,
            )
            total_sum, total_n = D.global_sum([float(kl_sum.detach()), n])
            if kl_sum.requires_grad:
                (setup.text_kl_weight * kl_sum / max(total_n, 1)).backward()
    return total_sum / max(total_n, 1)

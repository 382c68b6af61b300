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
  4. Latents composed once per distinct experience text (`teacher_context`); the chunks' gradients gather on a
     detached leaf and are pushed through the resampler once, after the last chunk (composer_step.py).
  5. loss_φ = KL + β·(m − δ̄) + λ·anchor (+ the reading term) back-propagated in pieces through
     `losses.composer_loss`: each chunk's shares of KL and δ̄ (m = 0, no anchor), then once the anchor with m. It
     is linear in its terms, so the pieces add up to the whole-batch loss_φ and its gradient.
  6. The low-memory order (`lopd.low_memory`, `lopd.teacher_micro_batch`: `teacher_first`).
  7. A share of the chunks training φ (`lopd.composer_fraction`), rescaled to the batch (batch.py).
  8. Several processes: sums and gradients reduced over ranks; FSDP2's sharded student (sharding.py).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

from lopd_core import distributed as D
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
from lopd_core.distill.update.composer_step import reading_backward, step_composer
from lopd_core.distill.update.dashboard import UpdateResult, step_result
from lopd_core.distill.update.inputs import StepModels, StepSetup
from lopd_core.distill.update.parts import TeacherContext, UpdateParts, context_embeddings, grad_norm, timed
from lopd_core.distill.update.state import DistillState
from lopd_core.envs import Task


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

    # the micro-batches (a task's samples together where they share a prompt), and which of them train φ
    # (`lopd.composer_fraction`, seeded by (seed, step))
    group = chunk_group(setup.samples_per_task, setup.share_prompt)
    chunks = micro_batches([len(i) for i in batch.token_ids], setup.micro_batch, group)
    picked = composer_chunks(len(chunks), setup.composer_fraction, setup.seed * 1_000_003 + state.step)
    scale = composer_scale(batch, chunks, picked)
    models.opt_theta.zero_grad(set_to_none=True)
    for c, chunk in enumerate(chunks):  # 2-4 on each micro-batch, gradients accumulated
        run_chunk(parts, chunk, beta=beta, scale=scale, train_composer=c in picked)
    kl_text = 0.0  # 4'. the reading term, into the latents' grad: only where φ trains and reads the text
    if setup.text_kl_weight and setup.method.composer.trainable and context.latents is not None:
        kl_text = reading_backward(parts)
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


def teacher_context(
    setup: StepSetup, models: StepModels, tasks: list[Task], trajs: list, batch: RolloutBatch
) -> TeacherContext:
    """2a. Retrieve, and compose latents once per distinct experience text (per task and text, for a composer
    that reads the task in front: composer.py): the G samples of a task (and tasks sharing a bank row) read the
    same texts, and the resampler treats each experience independently."""
    spec, group, device = setup.method, setup.samples_per_task, models.device
    per_task = models.retrieve(tasks) if spec.uses_bank else [[] for _ in tasks]
    # Baselines whose teacher reads text (or nothing) instead of latents: the composer reads nothing.
    text_context = B.text_contexts(spec, tasks, trajs, per_task, group)  # (B,) or None
    experiences = [per_task[i // group] if spec.needs_composer else [] for i in range(len(trajs))]
    # A trajectory without a context (SDPO's groups without a success) gives no signal: its tokens leave
    # the student loss and its normaliser. (Decided by the method, so every rank takes the same branch.)
    signal, n_signal = None, batch.n_tokens
    if spec.teacher.may_lack_context:
        has = torch.tensor([c is not None for c in text_context])
        signal = has.float().to(device)
        n_signal = max(int(D.global_sum([int(batch.token_counts[has].sum())])[0]), 1)
    # one latent row per distinct (query, experience): with a query-conditioned φ, per task and experience
    asked = models.queries_of([tasks[i // group] for i in range(len(trajs))]) or [""] * len(trajs)
    units = list(dict.fromkeys((asked[i], t) for i, ex in enumerate(experiences) for t in ex))
    slot = {u: i for i, u in enumerate(units)}
    texts = [t for _, t in units]
    queries = [q for q, _ in units] if models.composer.reads_query else None
    slots = [[slot[(asked[i], t)] for t in ex] for i, ex in enumerate(experiences)]
    context = TeacherContext(None, slots, texts, queries, text_context, signal, n_signal, None, None)
    if texts:
        states, state_mask = models.encoder.encode(texts, queries, lora=models.composer.encoder_lora)
        context.encoded = (states.to(device), state_mask.to(device))
        if setup.low_memory or not spec.composer.trainable:  # graph rebuilt at the end (or never: φ = φ0)
            with torch.no_grad():
                context.latents = models.composer(*context.encoded)
        else:
            context.composed = models.composer(*context.encoded)  # (U, K, D), graph to φ
            context.latents = context.composed.detach()
        context.latents.requires_grad_(spec.composer.trainable)
    return context


# ---- steps 2-4 on a chunk -------------------------------------------------------------------------------------


def run_chunk(parts: UpdateParts, chunk: list[int], *, beta: float, scale: ComposerScale, train_composer: bool) -> None:
    """Steps 2-4 on one chunk, gradients accumulated: the teacher's pass, the student's forward, loss share and
    backward, then the composer's piece — or, in the low-memory order, the teacher's passes and the composer's
    pieces first (`teacher_first`). A function so that every tensor of the chunk (logits, log-probs, padded
    inputs) is released when it returns, before the next chunk starts."""
    setup, models, batch, context, sums = parts.setup, parts.models, parts.batch, parts.context, parts.sums
    with timed(sums, "student"):
        sbatch = build_batch(models.student, *batch.rows(chunk))
    graph = setup.method.needs_composer and setup.method.composer.trainable and train_composer
    scores = targets = None  # GRPO without a reference KL: no teacher pass, the student alone
    if setup.teacher_pass and setup.low_memory:
        targets = teacher_first(parts, chunk, sbatch, beta=beta, scale=scale, graph=graph)
    elif setup.teacher_pass:
        with timed(sums, "teacher"):
            scores = score_rows(parts, chunk, graph=graph)  # 2.
        targets = scores.targets(keep_logits=setup.student_loss.reads_teacher_logits)
    with timed(sums, "student"):  # 3. the chunk's share of the batch's token mean, backward
        s_logits = action_logits(models.student, sbatch)  # (n, V)
        rows = torch.tensor(chunk, dtype=torch.long, device=s_logits.device)[sbatch.token_traj_index]  # (n,)
        loss = setup.student_loss
        per_token = S.student_token_loss(
            s_logits,
            sbatch.action_ids,
            targets,
            loss,
            pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
            distill_weight=None if batch.distill_weight is None else batch.distill_weight[rows],
            sample_logprobs=(
                batch.action_sample_logprobs(chunk, s_logits.device) if loss.reads_sample_logprobs else None
            ),
        )
        if context.signal is not None:
            per_token = per_token * context.signal[rows]
        share = per_token.sum() / context.n_signal
        share.backward()
        sums.shares["distill"] += float(share.detach())
        del per_token, share
        if setup.low_memory and setup.teacher_pass:
            return  # s_old was taken before the teacher's passes
        s_lp_old = torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V) the pre-update student, sg[p_S,old]
        del s_logits
        sums.add_student_entropy(s_lp_old)
        s_old = None if scores is None else S.StudentOld.of(s_lp_old, targets.topk_ids, sbatch.action_ids)
        del s_lp_old
    if scores is not None:
        with timed(sums, "composer"):
            composer_backward(batch, chunk, scores, s_old, sums, beta=beta, scale=scale)  # 4.


def teacher_first(
    parts: UpdateParts, chunk: list[int], sbatch: ScoringBatch, *, beta: float, scale: ComposerScale, graph: bool
) -> S.StudentTargets:
    """The low-memory order (`lopd.low_memory`): s_old from a no-grad student forward first, so each teacher
    pass (`lopd.teacher_micro_batch` consecutive rows; 0 = the whole chunk) is consumed by the composer's
    backward before the next, and the student's graph is built only after the last (`run_chunk`, with the
    targets returned here). Peak memory is the larger of the two graphs rather than both, for one more student
    forward per chunk (and one more resampler forward, composer_step.py). The chunk's action tokens are ordered
    row by row, so a pass's tokens are a contiguous slice of the student's."""
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
    return S.StudentTargets.cat(targets)  # s_lp_old goes on return: not alive through the student's backward


def score_rows(parts: UpdateParts, rows: list[int], *, graph: bool) -> S.TeacherScores:
    """Step 2 on `rows` with this method's teacher weights and context: the latents (or a baseline's text, or
    nothing) each row's teacher splices in, checked to fit, then the teacher's scores; the graph to the latents
    is kept when `graph` (for step 4). The keys tell a shared-prompt pass which rows read the same context."""
    setup, models, context = parts.setup, parts.models, parts.context
    ids, masks = parts.batch.rows(rows)
    with models.teacher_lm(setup.method.teacher.weights) as lm, nullcontext() if graph else torch.no_grad():
        ctx = keys = None
        if setup.method.needs_composer:
            ctx = [context.row_latents(i, models) for i in rows]
            keys = [tuple(context.slots[i]) for i in rows]  # equal slots: the same latent rows
        elif context.text_context is not None:
            texts = [context.text_context[i] for i in rows]
            ctx = context_embeddings(setup, models.tokenizer, lm, texts, [len(r) for r in ids])
            keys = [(context.text_context[i], c.shape[0]) for i, c in zip(rows, ctx)]  # the text as cut
        for k, row in enumerate(ids):  # the student's rollouts leave room for the splice (`splice_room`)
            spliced = 0 if ctx is None or ctx[k].shape[0] == 0 else ctx[k].shape[0] + 3
            if len(row) + spliced > setup.max_context:  # a trajectory from elsewhere: named rather than scored
                raise ValueError(
                    f"a trajectory of {len(row)} tokens with the teacher's {spliced} spliced positions exceeds "
                    f"rollout.max_context={setup.max_context}: roll it out with max_context reduced by "
                    f"Distiller.splice_room ({setup.splice_room})"
                )
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


# ---- θ's optimizer step (φ's: composer_step.py) -----------------------------------------------------------------


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

"""One LOPD update (DESIGN §3, steps 2-5) read top to bottom: start reading here.

This is the update the trainer runs in the simple configuration — the whole batch at once (lopd.micro_batch 0), no
prompt shared between a task's samples, one process (`StepSetup.runs_reference`). update.py is the same update with
named optimisations (its docstring lists them), run wherever the settings ask for one;
tests/distill/test_reference_update.py holds the two equal for every method of the methods table. Here, none of
them: one teacher pass per step that reads it (step 2 without a graph, step 4 again with one), latents composed per
trajectory, and loss_φ built as ONE tensor and back-propagated. Like update.py, a non-finite loss or gradient norm
skips that optimizer step (counted in `DistillState.skipped_updates`).
"""

from __future__ import annotations

import math
import time

import torch

from lopd_core.distill.composer.composer import compose_latents
from lopd_core.distill.composer.reading import reading_kl, reading_rows
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.teacher import action_logits, build_batch
from lopd_core.distill.teacher import baselines as B
from lopd_core.distill.update import margin_pricing as P
from lopd_core.distill.update import step as S
from lopd_core.distill.update.batch import RolloutBatch
from lopd_core.distill.update.dashboard import ComposerStep, UpdateResult, step_result
from lopd_core.distill.update.inputs import StepModels, StepSetup
from lopd_core.distill.update.parts import context_embeddings
from lopd_core.distill.update.state import DistillState
from lopd_core.envs import Task


def reference_update(
    setup: StepSetup, models: StepModels, state: DistillState, tasks: list[Task], trajs: list, *, started=None, log
) -> UpdateResult:
    """Steps 2-5 on `trajs` with `models`' weights and optimizers and `state`'s β, in the order of DESIGN §3.
    Longer than the 60 lines a function may take, on purpose (up to 90): the one LOPD update in one place, in
    cleanrl's order (batch, teacher, student loss, composer loss, optimizer steps, dual ascent, the row)."""
    t_update = time.perf_counter()
    started = t_update if started is None else started
    spec, loss, device, beta = setup.method, setup.student_loss, models.device, state.beta
    # ---- the rollout batch: ids, masks, advantages A(τ), the normalisers
    batch = setup.rollout_batch(state, trajs, device)
    ids, n_tokens = batch.token_ids, batch.n_tokens
    sums = S.StepSums.zeros(len(ids), device)  # what the row reads (dashboard.py)
    # ---- 2a. the teacher's context per trajectory: latents c_φ (graph to φ), a text, or nothing
    experiences, latents, texts, signal = teacher_inputs(setup, models, tasks, trajs)
    n_signal = n_tokens if signal is None else max(int(batch.token_counts[signal.cpu()].sum()), 1)
    # ---- 2. the teacher scores the student's tokens: its top-k log-probs and ids (no graph)
    scores = teacher_scores(setup, models, batch, latents, texts, graph=False) if setup.teacher_pass else None
    # ---- 3. the student loss, a token mean (over the trajectories with signal)
    sbatch = build_batch(models.student, ids, batch.action_masks)
    s_logits = action_logits(models.student, sbatch)  # (n, V)
    rows = sbatch.token_traj_index  # (n,) each token's trajectory
    per_token = S.student_token_loss(
        s_logits,
        sbatch.action_ids,
        None if scores is None else scores.targets(loss.reads_teacher_logits),
        loss,
        pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
        distill_weight=None if batch.distill_weight is None else batch.distill_weight[rows],
        sample_logprobs=batch.action_sample_logprobs(list(range(len(ids))), device),
    )
    loss_theta = (per_token if signal is None else per_token * signal[rows]).sum() / n_signal
    s_lp_old = torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V) the pre-update student, sg[p_S,old]
    sums.shares["distill"] = float(loss_theta.detach())
    sums.add_student_entropy(s_lp_old)
    # ---- 4. the composer loss: loss_φ = KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor, one tensor
    trains_phi = spec.needs_composer and spec.composer.trainable
    kl_phi = delta_bar = anchor = kl_text = torch.zeros((), device=device)
    if scores is not None:
        sums.add_teacher(scores)
        scores_phi = teacher_scores(setup, models, batch, latents, texts, graph=trains_phi)  # step 2's pass, graph
        s_old = S.StudentOld.of(s_lp_old, scores_phi.topk_ids, sbatch.action_ids)
        terms = S.composer_terms(scores_phi, s_old, batch.advantage)
        kl_phi, delta_bar = terms.kl_tokens.sum() / n_tokens, terms.delta.sum() / batch.n_scored
        sums.add_composer(terms, rows, float(kl_phi.detach()), float(delta_bar.detach()))
    if setup.margin(state) is None:  # `lopd.margin: auto` with nothing stored to price on: this step's successes
        P.price_on_batch(setup, state, batch, sums.gap, log)
    margin = setup.margin(state)
    flat = torch.cat(latents) if latents else torch.zeros((0, models.latent_width), device=device)
    if trains_phi and len(flat):  # a batch that retrieved nothing has no latents to anchor (a mean of none: NaN)
        queries = models.queries_of([tasks[i // setup.samples_per_task] for i in range(len(experiences))])
        anchor = L.anchor_loss(flat, torch.cat(models.anchor(experiences, queries)).to(device))
    if trains_phi and setup.text_kl_weight:  # the reading term (reading.py): φ reads the bank as the text does
        kl_text = reading_term(setup, models, batch, latents, experiences)
    weight = spec.composer.anchor_weight
    loss_phi = L.composer_loss(kl_phi, delta_bar, beta=beta, margin=margin, anchor=anchor, anchor_weight=weight)
    loss_phi = loss_phi + setup.text_kl_weight * kl_text
    # ---- the optimizer steps: θ on loss_θ, φ on loss_φ
    grad_theta, grad_phi = optimizer_steps(setup, models, state, loss_theta, loss_phi if trains_phi else None, log=log)
    # ---- 5. dual ascent on β (only for a composer that learns)
    if trains_phi and math.isfinite(float(delta_bar.detach())):
        state.beta = L.dual_ascent(beta, margin=margin, delta_bar=float(delta_bar.detach()), lr=setup.beta_lr)
    state.step += 1
    # ---- the dashboard row (dashboard.py)
    latent_norm = float(flat.detach().norm(dim=-1).mean()) if len(flat) else 0.0
    composer = ComposerStep(float(anchor.detach()), grad_phi, latent_norm, float(kl_text.detach()))
    return step_result(
        setup,
        models,
        state,
        batch,
        sums,
        totals=sums.shares,
        beta=beta,
        grad_theta=grad_theta,
        composer=composer,
        started=started,
        rollout_s=t_update - started,
        trajectories=trajs,
    )


def teacher_inputs(setup: StepSetup, models: StepModels, tasks: list[Task], trajs: list):
    """Per trajectory: its retrieved experiences, the composer's latents of them ((J·K, D), graph to φ; None for
    a teacher that reads no latents), the text a baseline's teacher reads instead (None: latents or nothing),
    and SDPO's signal mask (True where the teacher has a context; None for the other methods)."""
    spec, group = setup.method, setup.samples_per_task
    per_task = models.retrieve(tasks) if spec.uses_bank else [[] for _ in tasks]
    experiences = [per_task[i // group] for i in range(len(trajs))]
    texts = B.text_contexts(spec, tasks, trajs, per_task, group)
    queries = models.queries_of([tasks[i // group] for i in range(len(trajs))])
    latents = compose_latents(models.composer, models.encoder, experiences, queries) if spec.needs_composer else None
    has_context = None if not spec.teacher.may_lack_context else [t is not None for t in texts]
    signal = None if has_context is None else torch.tensor(has_context, device=models.device)
    return experiences, latents, texts, signal


def teacher_scores(
    setup: StepSetup, models: StepModels, batch: RolloutBatch, latents, texts, *, graph: bool
) -> S.TeacherScores:
    """The teacher's pass over the whole batch, each row with its own context; the graph to φ when `graph`."""
    with models.teacher_lm(setup.method.teacher.weights) as lm, torch.set_grad_enabled(graph):
        lengths = [len(r) for r in batch.token_ids]
        ctx = latents if texts is None else context_embeddings(setup, models.tokenizer, lm, texts, lengths)
        ctx = None if ctx is None else [c if graph else c.detach() for c in ctx]
        return S.score_teacher(
            lm,
            batch.token_ids,
            batch.action_masks,
            ctx,
            None,
            framing=models.framing,
            share_prompt=False,
            top_k=setup.top_k,
            temperature=setup.method.teacher.temperature,
            keep_logits=setup.student_loss.reads_teacher_logits,
        )


def reading_term(setup: StepSetup, models: StepModels, batch: RolloutBatch, latents, experiences) -> torch.Tensor:
    """KL(p_text ‖ p_latent), a token mean over the reading rows (reading.py), with its graph to φ."""
    picked = reading_rows(len(batch), setup.samples_per_task, setup.text_kl_rows)
    ids, masks = batch.rows(picked)
    with models.teacher_lm(setup.method.teacher.weights) as lm:
        kl_sum, n = reading_kl(
            lm,
            ids,
            masks,
            [latents[i] for i in picked],
            [experiences[i] for i in picked],
            tokenizer=models.tokenizer,
            framing=models.framing,
            max_context=setup.max_context,
        )
    return kl_sum / max(n, 1)


def optimizer_steps(
    setup: StepSetup, models: StepModels, state: DistillState, loss_theta, loss_phi, *, log
) -> tuple[float, float]:
    """Back-propagate both losses, clip, step θ (and SDPO's EMA teacher after it), then φ; returns the gradient
    norms before clipping. `loss_phi` None: φ does not learn. A non-finite loss or norm skips that step."""
    models.opt_theta.zero_grad(set_to_none=True)
    models.opt_phi.zero_grad(set_to_none=True)
    # a loss with no graph (a batch that read no experience: nothing reached φ) has nothing to back-propagate
    for loss in (loss_theta, loss_phi):
        if loss is not None and loss.requires_grad:
            loss.backward()
    norms = []
    for module in (models.trainable, models.composer):
        params = [p for p in module.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, setup.max_grad_norm)))
    if math.isfinite(float(loss_theta.detach())) and math.isfinite(norms[0]):
        models.opt_theta.step()
        if models.ema is not None:  # SDPO's EMA teacher follows the student
            B.update_ema(models.ema, models.student, setup.ema_decay)
    else:
        skipped(state, "student", log)
    if loss_phi is not None and math.isfinite(float(loss_phi.detach())) and math.isfinite(norms[1]):
        models.opt_phi.step()
    elif loss_phi is not None:
        skipped(state, "composer", log)
    return norms[0], norms[1]


def skipped(state: DistillState, what: str, log) -> None:
    state.skipped_updates += 1
    log(f"distill: step {state.step + 1}: non-finite {what} loss/gradient, update skipped")

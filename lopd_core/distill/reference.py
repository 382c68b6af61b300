"""One LOPD update (DESIGN §3, steps 2-5) read top to bottom: the specification that update.py optimises.

None of update.py's optimisations: the whole batch at once (no micro-batches), one teacher pass per step that
reads it (step 2 without a graph, step 4 again with one; no prompt shared between a task's samples), latents
composed per trajectory, no low-memory order, and loss_φ built as ONE tensor and back-propagated. One process,
and no skipping of non-finite updates. tests/distill/test_reference_update.py holds `Distiller.update` equal to it
for every method of the methods table; nothing else calls it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from lopd_core.distill import baselines as B
from lopd_core.distill import losses as L
from lopd_core.distill import margin as MG
from lopd_core.distill import step as S
from lopd_core.distill.composer import compose_latents
from lopd_core.distill.dashboard import TEACHER_COLUMNS, DashboardRow
from lopd_core.distill.reading import reading_kl, reading_rows
from lopd_core.distill.teacher import action_logits, build_batch
from lopd_core.distill.teacher_context import context_embeddings, teacher_lm
from lopd_core.envs import Task

if TYPE_CHECKING:
    from lopd_core.distill.trainer import Distiller


def reference_update(d: Distiller, tasks: list[Task], trajs: list) -> DashboardRow:
    """Steps 2-5 on `trajs` with `d`'s models, optimizers and β, in the order of DESIGN §3; returns the row."""
    started, cfg, spec, loss = time.perf_counter(), d.cfg, d.method, d.student_loss
    beta, margin, device = d.state.beta, d.margin, d.composer.queries.device
    # ---- the rollout batch: ids, masks, advantages A(τ), the normalisers
    batch = S.rollout_batch(
        trajs,
        samples_per_task=cfg.samples_per_task,
        advantage=cfg.advantage,
        device=device,
        group_std_eps=d.params.baselines.group_std_eps if loss.needs_pg_advantage else None,
    )
    ids, n_tokens = batch.token_ids, batch.n_tokens
    # ---- 2a. the teacher's context per trajectory: latents c_φ (graph to φ), a text, or nothing
    experiences, latents, texts, signal = teacher_inputs(d, tasks, trajs)
    n_signal = n_tokens if signal is None else max(int(batch.token_counts[signal.cpu()].sum()), 1)
    # ---- 2. the teacher scores the student's tokens: its top-k log-probs and ids (no graph)
    scores = teacher_scores(d, batch, latents, texts, graph=False) if d.teacher_pass else None
    # ---- 3. the student loss, a token mean (over the trajectories with signal)
    sbatch = build_batch(d.student, ids, batch.action_masks)
    s_logits = action_logits(d.student, sbatch)  # (n, V)
    rows = sbatch.token_traj_index  # (n,) each token's trajectory
    per_token = S.student_token_loss(
        s_logits,
        sbatch.action_ids,
        None if scores is None else scores.targets(loss.reads_teacher_logits),
        loss,
        pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
        sample_logprobs=batch.action_sample_logprobs(list(range(len(ids))), device),
    )
    loss_theta = (per_token if signal is None else per_token * signal[rows]).sum() / n_signal
    s_lp_old = torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V) the pre-update student, sg[p_S,old]
    # ---- 4. the composer loss: loss_φ = KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor, one tensor
    trains_phi = spec.needs_composer and spec.composer.trainable
    kl_phi = delta_bar = anchor = torch.zeros((), device=device)
    gaps = torch.zeros(len(ids), dtype=torch.float64)  # per trajectory: Σ log p_T,φ(a) − log p_S,old(a)
    if scores is not None:
        scores_phi = teacher_scores(d, batch, latents, texts, graph=trains_phi)  # step 2's pass, graph to φ
        terms = S.composer_terms(
            scores_phi, S.StudentOld.of(s_lp_old, scores_phi.topk_ids, sbatch.action_ids), batch.advantage
        )
        kl_phi, delta_bar = terms.kl_tokens.sum() / n_tokens, terms.delta.sum() / batch.n_scored
        gaps.index_add_(0, rows.cpu(), terms.gap.detach().double().cpu())
    flat = torch.cat(latents) if latents else torch.zeros((0, d.composer.proj_out.out_features), device=device)
    if trains_phi:
        queries = d.queries_of([tasks[i // cfg.samples_per_task] for i in range(len(experiences))])
        anchor = L.anchor_loss(flat, torch.cat(d.anchor_latents(experiences, queries)).to(device))
    kl_text = torch.zeros((), device=device)  # the reading term (reading.py): φ reads the bank as the text does
    if trains_phi and cfg.text_kl_weight:
        picked = reading_rows(len(ids), cfg.samples_per_task, cfg.text_kl_rows)
        with teacher_lm(d) as lm:
            kl_sum, n = reading_kl(
                lm,
                d.tokenizer,
                d.framing,
                [ids[i] for i in picked],
                [batch.action_masks[i] for i in picked],
                [latents[i] for i in picked],
                [experiences[i] for i in picked],
                max_context=d.params.rollout.max_context,
            )
        kl_text = kl_sum / max(n, 1)
    loss_phi = (
        L.composer_loss(
            kl_phi, delta_bar, beta=beta, margin=margin, anchor=anchor, anchor_weight=spec.composer.anchor_weight
        )
        + cfg.text_kl_weight * kl_text
    )
    # ---- the optimizer steps: θ on loss_θ, φ on loss_φ
    grad_theta, grad_phi = optimizer_steps(d, loss_theta, loss_phi if trains_phi else None)
    # ---- 5. dual ascent on β (only for a composer that learns)
    if trains_phi:
        d.state.beta = L.dual_ascent(beta, margin=margin, delta_bar=float(delta_bar), lr=cfg.beta_lr)
    d.state.step += 1
    # ---- the dashboard row
    deltas = batch.advantage.double().cpu() * gaps / batch.token_counts.clamp(min=1)  # δ(τ)
    delta_success, delta_failure = MG.delta_parts(deltas, batch.token_counts, batch.successes)
    row = DashboardRow(
        step=d.state.step,
        rollouts=d.state.rollouts,
        reward_mean=float(batch.rewards.mean()),
        success_rate=float(batch.successes.float().mean()),
        distill_loss=float(loss_theta),
        kl_phi=float(kl_phi),
        delta=float(delta_bar),
        beta=beta,
        margin=margin,
        delta_success=delta_success,
        delta_failure=delta_failure,
        anchor=float(anchor),
        kl_text=float(kl_text),
        student_entropy=float(-(s_lp_old.exp() * s_lp_old).sum()) / n_tokens,
        teacher_entropy=0.0 if scores is None else scores.entropy_sum / n_tokens,
        topk_mass=0.0 if scores is None else float(scores.topk_logprobs.exp().sum()) / n_tokens,
        grad_norm_theta=grad_theta,
        grad_norm_phi=grad_phi,
        latent_norm_ratio=float(flat.detach().norm(dim=-1).mean()) / d.embedding_norm if len(flat) else 0.0,
        step_seconds=time.perf_counter() - started,
        phase=d.phase,
        teacher_refreshes=d.state.teacher_refreshes,
    )
    return row if d.teacher_pass else replace(row, **dict.fromkeys(TEACHER_COLUMNS, math.nan))


def teacher_inputs(d: Distiller, tasks: list[Task], trajs: list):
    """Per trajectory: its retrieved experiences, the composer's latents of them ((J·K, D), graph to φ; None for
    a teacher that reads no latents), the text a baseline's teacher reads instead (None: latents or nothing),
    and SDPO's signal mask (True where the teacher has a context; None for the other methods)."""
    spec, group, device = d.method, d.cfg.samples_per_task, d.composer.queries.device
    per_task = d.retriever(tasks) if spec.uses_bank else [[] for _ in tasks]
    experiences = [per_task[i // group] for i in range(len(trajs))]
    texts = B.text_contexts(spec, tasks, trajs, per_task, group)
    queries = d.queries_of([tasks[i // group] for i in range(len(trajs))])
    latents = compose_latents(d.composer, d.encoder, experiences, queries) if spec.needs_composer else None
    signal = None if spec.teacher.context != "sibling" else torch.tensor([t is not None for t in texts], device=device)
    return experiences, latents, texts, signal


def teacher_scores(d: Distiller, batch: S.RolloutBatch, latents, texts, *, graph: bool) -> S.TeacherScores:
    """The teacher's pass over the whole batch, each row with its own context; the graph to φ when `graph`."""
    with teacher_lm(d) as lm, torch.set_grad_enabled(graph):
        ctx = latents if texts is None else context_embeddings(d, lm, texts, [len(r) for r in batch.token_ids])
        ctx = None if ctx is None else [c if graph else c.detach() for c in ctx]
        return S.score_teacher(
            lm,
            batch.token_ids,
            batch.action_masks,
            ctx,
            None,
            framing=d.framing,
            share_prompt=False,
            top_k=d.cfg.top_k,
            temperature=d.method.teacher.temperature,
            keep_logits=d.student_loss.reads_teacher_logits,
        )


def optimizer_steps(d: Distiller, loss_theta: torch.Tensor, loss_phi: torch.Tensor | None) -> tuple[float, float]:
    """Back-propagate both losses, clip, step θ (and SDPO's EMA teacher after it), then φ; returns the gradient
    norms before clipping. `loss_phi` None: φ does not learn."""
    d.opt_theta.zero_grad(set_to_none=True)
    d.opt_phi.zero_grad(set_to_none=True)
    loss_theta.backward()
    if loss_phi is not None:
        loss_phi.backward()
    norms = []
    for module in (d.trainable, d.composer):
        params = [p for p in module.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, d.cfg.max_grad_norm)))
    d.opt_theta.step()
    if d.ema_lm is not None:
        B.update_ema(d.ema_lm, d.student, d.params.baselines.ema_decay)
    d.opt_phi.step()
    return norms[0], norms[1]

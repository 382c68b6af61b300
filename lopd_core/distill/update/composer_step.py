"""φ's side of update.py's update, after the chunks: the reading term into the latents' gradient (only where φ
trains and reads text: before θ's step, as the reference orders it), then, after θ's step, the composer's step —
the anchor's piece of loss_φ with m and the gradient the chunks gathered on the latents' leaf, one backward through
the resampler, φ's optimizer step (DESIGN §3, step 4's end). update.py's module docstring says why loss_φ is
back-propagated in pieces; this file is its last piece. A file of its own because on the default (φ frozen)
none of it is on the way to θ's optimizer step.
"""

from __future__ import annotations

import math

import torch

from lopd_core import distributed as D
from lopd_core.distill.composer.reading import reading_kl, reading_rows
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.update.dashboard import ComposerStep
from lopd_core.distill.update.parts import UpdateParts, grad_norm, timed
from lopd_core.distill.update.state import DistillState


def reading_backward(parts: UpdateParts) -> float:
    """The composer's reading term (reading.py): w · KL(p_text ‖ p_latent) on a few of the step's rows, backward
    into the latents' leaf, whose gradient step_composer then pushes through the resampler with the rest of
    loss_φ. Returns the KL (a token mean over every rank's rows). update calls it only where it acts: φ trains,
    the weight is set and the step has latents."""
    setup, models, batch, context, sums = parts.setup, parts.models, parts.batch, parts.context, parts.sums
    with timed(sums, "composer"):
        rows = reading_rows(len(batch), setup.samples_per_task, setup.text_kl_rows)
        ids, masks = batch.rows(rows)
        texts = [[context.texts[j] for j in context.slots[i]] for i in rows]
        with models.teacher_lm(setup.method.teacher.weights) as lm:
            latents = [context.row_latents(i, models) for i in rows]
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

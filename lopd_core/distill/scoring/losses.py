"""LOPD losses as pure functions: tensors in, tensors out, no state, no logging.

Vocabulary for shapes: N = supervised tokens (the flattened action positions of a batch), V = vocabulary,
K = top-k support size, B = trajectories. Every divergence returns one value **per token** (N,); masking and
averaging happen at the call site (the trainer divides the summed per-token loss by the number of supervised
tokens, so each sampled action counts once whatever trajectory it belongs to). The exceptions say so: the
privileged margin is per trajectory (B,), and `anchor_loss` and `composer_loss` reduce to scalars.

Inputs are upcast to float32 (float64 is kept as is, for tests); bf16 logits are never differenced or
exponentiated in their own precision.

Student losses (the student policy p_S learns toward the teacher p_T, a frozen base conditioned on latents):
  * `reverse_kl_topk` (default) — KL(p_S || p_T) over the teacher's top-K token ids plus one tail bucket that
    holds the remaining mass of each side. It needs only K teacher log-probs per token (what a teacher pass can
    cheaply store next to a rollout). Coarse-graining the vocabulary into K + 1 buckets can only lose
    information, so it is a lower bound on the full-vocabulary KL and equals it when K = V. It is not the
    paper's exact objective (the full KL); with K a few dozen the tail carries little mass.
  * `reverse_kl_full` — the exact KL(p_S || p_T) over the full vocabulary, in chunks of rows, each chunk under
    activation checkpointing when gradients are needed, so the (N, V) float32 intermediates of log-softmax
    never all live at once (only the input logits are kept for backward).
  * `reverse_kl_sampled` — the single-sample estimator log p_S(a) − log p_T(a) on the policy's own tokens
    a ~ p_S. Its value is unbiased for the reverse KL; its gradient is the policy-gradient form
    E[(log p_S − log p_T) ∇ log p_S] (the score term E[∇ log p_S] is zero in expectation and dropped). It is
    per-token: a token is credited only with its own log-ratio, not with the KL of the tokens it leads to
    (discount zero), a simplification of the sequence-level reverse KL.
  * `forward_kl_topk` — KL(p_T || p_S) on the same K + 1 buckets: the mass-covering direction. Reverse KL is
    mode-seeking: the student may drop a teacher mode it finds costly, which transfers a skill (a way to act) well
    and a fact (this world's convention, one token the teacher puts most of its mass on) less reliably; the forward
    direction charges the student for every bucket the teacher weighs, whatever the student's own mass there.
  * `mixed_kl_topk` — (1 − w) · reverse + w · forward per token, w = `lopd.kl_mix` (0: exactly the reverse KL).
  * `forward_kl_full` — KL(p_T || p_S) over the full vocabulary (the cold start's KL toward the text reader).
  * `truncated_importance_weight` — min(p_S(a) / p_sample(a), cap), detached, for the sampled-token estimator
    only: rollouts drawn at a temperature (or top-p) other than p_S's draw a from p_sample, and the weight turns
    the estimator's expectation back into one under p_S; the cap bounds its variance (truncated importance
    sampling, biased toward the sampler when it truncates). The top-k and full losses take the exact KL over
    every token at the visited state, which does not depend on the token sampled there, so the ratio of that
    token corrects nothing of theirs (what they miss is the distribution of the states, whose correction is the
    product of the ratios of all earlier tokens: not done). The config rejects the weight with them.

Composer losses (the composer φ produces the latents; it learns through the frozen teacher):
  * `advantages` — per trajectory: "continuous" 2r − 1 (the paper's, r ∈ [0, 1]); "binary" ±1 from success
    and "group" r − mean_group(r) (a GRPO-style baseline without std normalisation) are additions.
  * `privileged_margin_delta` — δ(τ) = A(τ) · mean over τ's action tokens of (log p_T,φ(a) − sg[log p_S,old(a)]):
    the teacher should be more likely than the student on the actions of successes and less on failures.
    δ̄ is the plain mean of δ(τ) over the batch's trajectories that have action tokens (the trainer sums δ(τ)
    per chunk and divides by the whole batch's trajectory count, over ranks too, so it is exact under
    micro-batching and data parallelism). Why a mean over trajectories and not over tokens: the constraint
    δ̄ ≥ m is an expectation over trajectories, and one trajectory is one vote — a token mean
    (Σ n_τ δ(τ) / Σ n_τ) would let long trajectories, which are mostly failures that ran out of turns,
    decide δ̄ and hence β.
  * `dual_ascent` — the Lagrange multiplier: β ← max(0, β + lr · (m − δ̄)), rising while the constraint
    δ̄ ≥ m is violated.
  * `anchor_loss` — mean squared distance of the composer's latents to the cold-start composer φ0's (mean over
    all elements, so its scale does not depend on the number or width of the latents). An addition to the
    paper: it keeps the latents in the region the base was warm-started on.
  * `composer_loss` — KL(sg[p_S,old] || p_T,φ) + β · (m − δ̄) + λ · anchor, with β a constant in the step.

Numerical guards: a tail bucket's mass is clamped to ≥ 1e-8 (TAIL_FLOOR) before its log; log-probs entering a
KL are clamped to the float32 minimum so that a −inf (a masked token) gives 0 · (−huge) = 0 rather than NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

TAIL_FLOOR = 1e-8  # smallest tail-bucket mass; its log is the floor of every tail log-prob
_LOG_TAIL_FLOOR = math.log(TAIL_FLOOR)
_MAX_SUPPORT_LOGMASS = math.log1p(-TAIL_FLOOR)  # support log-mass above this would leave tail < TAIL_FLOOR
_ADVANTAGE_KINDS = ("continuous", "binary", "group")


def _f32(x: Tensor) -> Tensor:
    """Upcast to float32 (keep float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _finite_logprob(logp: Tensor) -> Tensor:
    # -inf -> float min: exp gives exactly 0, and 0 * (finite) stays 0 in the KL sum and its gradient
    return logp.clamp(min=torch.finfo(logp.dtype).min)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0, with 1 − exp(x) clamped to ≥ TAIL_FLOOR.

    Two branches for accuracy (Mächler's log1mexp): log1p(−exp(x)) far from 0, log(−expm1(x)) near 0. The input
    is clamped first so neither branch ever sees log(0): no inf in the forward, no NaN in the backward.
    """
    x = x.clamp(max=_MAX_SUPPORT_LOGMASS)
    near_zero = x > -math.log(2.0)
    # each branch gets an input that is safe for it, so the unused branch cannot poison the gradient
    far = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -1.0), x)))
    near = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -1.0))))
    return torch.where(near_zero, near, far).clamp(min=_LOG_TAIL_FLOOR)


# ---------------------------------------------------------------------------------------------------------
# Student: reverse KL toward the teacher
# ---------------------------------------------------------------------------------------------------------


def topk_support_logprobs(logits: Tensor, support_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probs of `logits` at the support ids, and the log of the mass outside them.

    logits (N, V), support_ids (N, K) long, distinct within a row -> ((N, K), (N,)).
    The tail is the logsumexp of the log-softmax over the non-support ids (support ids masked out), not
    log(1 − Σ support): no cancellation when the support holds almost all the mass. It is clamped to
    log(TAIL_FLOOR), so with K = V the tail is log(1e-8) rather than −inf (and carries no gradient).
    """
    logp = torch.log_softmax(_f32(logits), dim=-1)  # (N, V)
    support = logp.gather(-1, support_ids)  # (N, K)
    return support, tail_logsumexp(logp, support_ids)


class _OutsideLogsumexp(torch.autograd.Function):
    """logsumexp over each row's entries outside `support_ids`. Autograd's own scatter + logsumexp would keep
    the (N, V) masked copy for the backward; this keeps only the log-probs, which the log-softmax that made them
    keeps anyway, and forms the same gradient from them (the same operations, so the same bits)."""

    @staticmethod
    def forward(ctx, logp: Tensor, support_ids: Tensor) -> Tensor:
        # a finite fill, not -inf: logsumexp of an all -inf row would have a NaN gradient
        outside = logp.scatter(-1, support_ids, torch.finfo(logp.dtype).min)  # (N, V), freed on return
        out = torch.logsumexp(outside, dim=-1)  # (N,)
        ctx.save_for_backward(logp, support_ids, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logp, support_ids, out = ctx.saved_tensors
        # logsumexp's backward, grad · exp(x − out), then the scatter's: nothing flows to the support ids
        return (grad[:, None] * (logp - out[:, None]).exp()).scatter(-1, support_ids, 0.0), None


def tail_logsumexp(logprobs: Tensor, support_ids: Tensor) -> Tensor:
    """Log of the mass outside `support_ids`: (N, V) normalised log-probs, (N, K) ids -> (N,), clamped to
    log(TAIL_FLOOR) (with K = V the tail is log(1e-8) rather than −inf, and carries no gradient)."""
    return _OutsideLogsumexp.apply(logprobs, support_ids).clamp(min=_LOG_TAIL_FLOOR)


def support_kl(p_logprobs: Tensor, p_tail_logprob: Tensor, q_logprobs: Tensor, q_tail_logprob: Tensor) -> Tensor:
    """KL(p || q) over K support ids plus one tail bucket, per token.

    p_logprobs, q_logprobs (N, K); p_tail_logprob, q_tail_logprob (N,) -> (N,).
    Nothing is detached: gradients reach whichever side requires grad (the student loss differentiates p, the
    composer's KL(sg[p_S,old] || p_T,φ) differentiates q).
    """
    p = _finite_logprob(_f32(p_logprobs))
    q = _finite_logprob(_f32(q_logprobs))
    p_tail = _finite_logprob(_f32(p_tail_logprob))
    q_tail = _finite_logprob(_f32(q_tail_logprob))
    support_term = (p.exp() * (p - q)).sum(dim=-1)  # (N,)
    tail_term = p_tail.exp() * (p_tail - q_tail)  # (N,)
    return support_term + tail_term


def reverse_kl_topk(student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor) -> Tensor:
    """Default student loss: KL(p_S || p_T) on the teacher's top-k support plus one tail bucket, per token.

    student_logits (N, V); teacher_topk_logprobs (N, K), the teacher's full-vocabulary log-probs at its own
    top-k ids (N, K) -> (N,). The teacher's tail is 1 − Σ exp(teacher_topk_logprobs), via a guarded log1mexp
    (clamped to ≥ TAIL_FLOOR); the student's is the exact mass of its non-support ids.
    The teacher log-probs are used as given: detach them at the call site if they carry a graph.
    """
    s_support, s_tail = topk_support_logprobs(student_logits, teacher_topk_ids)  # (N, K), (N,)
    t_support = _f32(teacher_topk_logprobs)  # (N, K)
    t_tail = _log1mexp(torch.logsumexp(t_support, dim=-1))  # (N,)
    return support_kl(s_support, s_tail, t_support, t_tail)


def forward_kl_topk(student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor) -> Tensor:
    """KL(p_T || p_S) on the teacher's top-k support plus one tail bucket, per token (the forward direction).

    student_logits (N, V); teacher_topk_logprobs (N, K) at the teacher's top-k ids (N, K) -> (N,). The buckets
    are `reverse_kl_topk`'s; only the direction differs: Σ_b p_T(b) (log p_T(b) − log p_S(b)). Its gradient in
    the student's logits is p_S − p_T per bucket, so the student is pulled toward every bucket the teacher
    weighs. The student's tail is clamped at log(TAIL_FLOOR), which keeps the term finite when the student puts
    almost nothing outside the support. The teacher log-probs are used as given (detach them at the call site).
    """
    s_support, s_tail = topk_support_logprobs(student_logits, teacher_topk_ids)  # (N, K), (N,)
    t_support = _f32(teacher_topk_logprobs)  # (N, K)
    t_tail = _log1mexp(torch.logsumexp(t_support, dim=-1))  # (N,)
    return support_kl(t_support, t_tail, s_support, s_tail)


def mixed_kl_topk(
    student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor, *, weight: float
) -> Tensor:
    """(1 − w) · KL(p_S || p_T) + w · KL(p_T || p_S) on the top-k + tail buckets, per token, w = `weight`.

    student_logits (N, V); teacher_topk_logprobs, teacher_topk_ids (N, K) -> (N,). w = 0 returns
    `reverse_kl_topk` itself and w = 1 `forward_kl_topk` (the same bits, not a product with 0 that a non-finite
    term could poison); in between, one log-softmax serves both directions.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if weight == 0.0:
        return reverse_kl_topk(student_logits, teacher_topk_logprobs, teacher_topk_ids)
    if weight == 1.0:
        return forward_kl_topk(student_logits, teacher_topk_logprobs, teacher_topk_ids)
    s_support, s_tail = topk_support_logprobs(student_logits, teacher_topk_ids)  # (N, K), (N,)
    t_support = _f32(teacher_topk_logprobs)  # (N, K)
    t_tail = _log1mexp(torch.logsumexp(t_support, dim=-1))  # (N,)
    reverse = support_kl(s_support, s_tail, t_support, t_tail)  # (N,)
    forward = support_kl(t_support, t_tail, s_support, s_tail)  # (N,)
    return (1.0 - weight) * reverse + weight * forward


def _full_kl_rows(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    s = torch.log_softmax(_f32(student_logits), dim=-1)  # (n, V)
    t = torch.log_softmax(_f32(teacher_logits), dim=-1)  # (n, V)
    return (s.exp() * (_finite_logprob(s) - _finite_logprob(t))).sum(dim=-1)  # (n,)


def reverse_kl_full(student_logits: Tensor, teacher_logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Exact KL(p_S || p_T) over the full vocabulary, per token.

    student_logits, teacher_logits (N, V) -> (N,). Rows are processed `chunk_size` at a time; when a gradient
    is needed each chunk runs under activation checkpointing (recomputed in backward), so memory beyond the
    input logits is bounded by one chunk's (chunk_size, V) intermediates.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}")
    n = student_logits.shape[0]
    if n == 0:
        return student_logits.new_zeros(0, dtype=_f32(student_logits).dtype)
    needs_grad = torch.is_grad_enabled() and (student_logits.requires_grad or teacher_logits.requires_grad)
    chunks = []
    for start in range(0, n, chunk_size):
        s = student_logits[start : start + chunk_size]
        t = teacher_logits[start : start + chunk_size]
        if needs_grad:
            chunks.append(checkpoint(_full_kl_rows, s, t, use_reentrant=False))
        else:
            chunks.append(_full_kl_rows(s, t))
    return torch.cat(chunks)


def forward_kl_full(student_logits: Tensor, teacher_logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Exact KL(p_T || p_S) over the full vocabulary, per token (N, V), (N, V) -> (N,): `reverse_kl_full`'s sum
    with the roles swapped, the gradient reaching p_S through the log-ratio (the cold start's text-to-latent KL)."""
    return reverse_kl_full(teacher_logits, student_logits, chunk_size=chunk_size)


def reverse_kl_sampled(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """Sampled-token estimator of KL(p_S || p_T) on the policy's own tokens, per token.

    student_logprobs, teacher_logprobs (N,): log-probs of the sampled tokens a ~ p_S -> (N,).
    Value: d = log p_S(a) − log p_T(a), whose expectation under a ~ p_S is the reverse KL.
    Gradient: sg[d] · ∇ log p_S(a), the policy-gradient (score-function) form, because
        ∇ KL = Σ_a ∇p_S(a) (log p_S(a) − log p_T(a)) + Σ_a p_S(a) ∇ log p_S(a) = E[d ∇ log p_S] + 0.
    Written as sg[d] + sg[d] · (s − sg[s]): the value is d (the second term is 0), and the gradient is that of
    sg[d] · s, i.e. the "(sg[student − teacher]) · student" surrogate without its value being d · s. The
    pathwise ∇d = ∇ log p_S(a) (zero mean, pure variance) is left out, and the teacher gets no gradient.
    When rollouts were sampled at another temperature or top-p, weight by `truncated_importance_weight` at the
    call site: this is the one student loss whose value depends on which token was sampled.
    """
    s = _f32(student_logprobs)
    d = (s - _f32(teacher_logprobs)).detach()
    return d + d * (s - s.detach())


def truncated_importance_weight(student_logprobs: Tensor, sample_logprobs: Tensor, *, cap: float = 2.0) -> Tensor:
    """min(p_S(a) / p_sample(a), cap), detached, per token.

    student_logprobs, sample_logprobs (N,) -> (N,). Corrects the sampled-token estimator for rollouts drawn at
    temperature != 1 (or with top-p) while the loss is about p_S. The ratio is capped in log space, so exp
    never overflows.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_ratio = (_f32(student_logprobs) - _f32(sample_logprobs)).detach()
    return torch.exp(log_ratio.clamp(max=math.log(cap)))


# ---------------------------------------------------------------------------------------------------------
# Composer: privileged margin, dual ascent, anchor
# ---------------------------------------------------------------------------------------------------------


def advantages(
    rewards: Tensor,
    *,
    kind: str = "continuous",
    successes: Tensor | None = None,
    group_ids: Tensor | None = None,
) -> Tensor:
    """Per-trajectory advantage A(τ), rewards (B,) -> (B,), float32, no gradient.

    "continuous": 2r − 1 (the paper's; r ∈ [0, 1] maps to [−1, 1]);
    "binary":     +1 for a success, −1 otherwise (needs `successes` (B,) bool);
    "group":      r − mean of r over the trajectories sharing the group id (a GRPO-style baseline, no std
                  normalisation; needs `group_ids` (B,) integer, e.g. the task index).
    """
    r = _f32(rewards).detach()
    if kind == "continuous":
        return 2.0 * r - 1.0
    if kind == "binary":
        if successes is None:
            raise ValueError("advantage kind 'binary' needs successes")
        return torch.where(successes.to(torch.bool), 1.0, -1.0).to(r.dtype)
    if kind == "group":
        if group_ids is None:
            raise ValueError("advantage kind 'group' needs group_ids")
        groups, inverse = torch.unique(group_ids, return_inverse=True)  # (G,), (B,) in [0, G)
        sums = torch.zeros(groups.numel(), dtype=r.dtype, device=r.device).index_add(0, inverse, r)  # (G,)
        counts = torch.bincount(inverse, minlength=sums.numel()).to(r.dtype)  # (G,), each >= 1
        return r - (sums / counts)[inverse]
    raise ValueError(f"unknown advantage kind {kind!r}; expected one of {', '.join(_ADVANTAGE_KINDS)}")


def privileged_margin_delta(
    teacher_logprobs: Tensor,
    student_old_logprobs: Tensor,
    advantage: Tensor,
    token_traj_index: Tensor,
    num_traj: int,
) -> Tensor:
    """δ(τ) = A(τ) · mean over τ's action tokens of (log p_T,φ(a) − sg[log p_S,old(a)]).

    teacher_logprobs, student_old_logprobs (N,); advantage (B,); token_traj_index (N,) long in [0, num_traj)
    -> (B,) with B = num_traj; a trajectory without tokens gets 0. The gradient flows into teacher_logprobs
    only: the old student log-probs and the advantage are detached. Divided by the trajectory's own token
    count, so that δ(τ) is a per-trajectory quantity; δ̄ is their mean over trajectories (module docstring).

    Mostly-failed batches, and the choice of `lopd.advantage`. Under `continuous` (2r − 1, the paper's and the
    default) and `binary` a failure has A(τ) < 0, so its δ(τ) rises as the teacher's log-prob of the student's
    own failed tokens falls — and any teacher that moves away from the student scores the student's samples
    lower. With most of a batch failing, the composer can thus meet δ̄ ≥ m by pushing the teacher away from the
    student on failures rather than by knowing more on successes. Decided: δ keeps the paper's definition under
    every advantage (a failure the teacher rates lower is real information, and `continuous` stays the
    default), and the incentive is handled around it: m is priced from successes alone (`lopd.margin: auto`,
    margin.py); δ̄'s parts on successes and on failures are on the dashboard (`delta_success`,
    `delta_failure`), where a δ̄ carried by failures shows; and `group` removes the incentive — A = r − the
    task's mean reward is 0 for every sample of an all-failed task and sums to 0 over a task's samples, so
    lowering the teacher's log-prob on all of a task's samples alike leaves δ̄ (a mean over trajectories)
    unchanged. tests/distill/test_priced_margin.py shows the parts under each advantage on a hand-built batch.
    """
    gap = _f32(teacher_logprobs) - _f32(student_old_logprobs).detach()  # (N,)
    sums = torch.zeros(num_traj, dtype=gap.dtype, device=gap.device).index_add(0, token_traj_index, gap)  # (B,)
    counts = torch.bincount(token_traj_index, minlength=num_traj).to(gap.dtype)  # (B,)
    return _f32(advantage).detach() * sums / counts.clamp(min=1.0)


def dual_ascent(beta: float, *, margin: float, delta_bar: float, lr: float) -> float:
    """One projected dual-ascent step: β ← max(0, β + lr · (m − δ̄)). β grows while δ̄ < m."""
    return max(0.0, float(beta) + float(lr) * (float(margin) - float(delta_bar)))


def anchor_loss(latents: Tensor, anchor_latents: Tensor) -> Tensor:
    """mean((latents − sg[anchor])²) over all elements, scalar: keeps the composer's latents near φ0's.

    Both tensors share one shape (any); the shapes are checked rather than broadcast.
    """
    if latents.shape != anchor_latents.shape:
        raise ValueError(f"latent shapes differ: {tuple(latents.shape)} vs {tuple(anchor_latents.shape)}")
    return (_f32(latents) - _f32(anchor_latents).detach()).pow(2).mean()


def composer_loss(
    kl_phi: Tensor, delta_bar: Tensor, *, beta: float, margin: float, anchor: Tensor | float, anchor_weight: float
) -> Tensor:
    """loss_φ = KL(sg[p_S,old] || p_T,φ) + β · (m − δ̄) + λ · anchor, scalar.

    kl_phi, delta_bar, anchor: scalars (0-dim tensors, already averaged; a float anchor is allowed, e.g. 0 when
    the anchor is off). β is a plain float, a constant of the step: ∂loss/∂δ̄ = −β pushes δ̄ up. The composer
    is trained through this function: whole in reference.py; in update.py in pieces that add up to it (it is
    linear in its terms), each micro-batch's shares of KL and δ̄, then the anchor with m.
    """
    for name, value in (("kl_phi", kl_phi), ("delta_bar", delta_bar), ("anchor", anchor)):
        if isinstance(value, Tensor) and value.dim() != 0:
            raise ValueError(f"{name} must be a scalar (0-dim) tensor, got shape {tuple(value.shape)}")
    return _f32(kl_phi) + float(beta) * (float(margin) - _f32(delta_bar)) + float(anchor_weight) * anchor

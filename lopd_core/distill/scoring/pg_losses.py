"""The baselines' losses: group-relative policy gradient (GRPO) and its KL to a reference (methods.py).

Per token like the distillation losses (losses.py): N = supervised tokens, B = trajectories; masking and
averaging at the call site. Inputs are upcast to float32 (float64 kept as is, for tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_core.distill.scoring import losses as _losses


def _f32(x: Tensor) -> Tensor:
    return _losses._f32(x)


def group_relative_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-4) -> Tensor:
    """GRPO's advantage, rewards (B,) and group_ids (B,) -> (B,): (r − mean_g r) / (std_g r + eps).

    std is the population std of the group (divided by G, not G − 1); a group whose rewards are all equal gets
    advantage 0 for every member (no signal), and `eps` keeps a near-constant group from blowing up.
    """
    centred = _losses.advantages(rewards, kind="group", group_ids=group_ids)  # (B,) r − group mean
    _, inverse = torch.unique(group_ids, return_inverse=True)
    var = torch.zeros(
        int(inverse.max()) + 1 if inverse.numel() else 0, dtype=centred.dtype, device=centred.device
    ).index_add(0, inverse, centred.pow(2))  # (G,) Σ (r − mean)²
    counts = torch.bincount(inverse, minlength=var.numel()).to(centred.dtype)  # (G,)
    std = (var / counts.clamp(min=1.0)).sqrt()[inverse]  # (B,)
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))  # equal rewards: exactly 0


def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantage: Tensor, *, clip: float = 0.2) -> Tensor:
    """PPO-clip surrogate per token, to minimise: −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A), ρ = p_θ(a) / p_old(a).

    logprobs (N,) with grad; old_logprobs (N,) (detached here); advantage (N,), the token's trajectory
    advantage -> (N,). The trainer passes the rollout's sampling log-probs as p_old: the distribution the
    tokens were actually drawn from. With one optimizer step per batch, sampling at temperature 1 and top-p 1,
    ρ is 1 up to float rounding and this is plain policy gradient −A·log p_θ in gradient; at another
    temperature or top-p, ρ is the importance ratio from the sampler to the policy, and the clip bounds it.
    """
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    log_ratio = _f32(logprobs) - _f32(old_logprobs).detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # (N,), the clamp only guards exp against overflow
    a = _f32(advantage).detach()
    return -torch.minimum(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)


def reference_kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token estimator of KL(p_θ ‖ p_ref) on sampled tokens a ~ p_θ: exp(q − s) − (q − s) − 1 with
    s = log p_θ(a), q = log p_ref(a) (Schulman's k3: unbiased, always ≥ 0, low variance). (N,), (N,) -> (N,);
    the reference gets no gradient."""
    d = _f32(ref_logprobs).detach() - _f32(logprobs)
    return torch.exp(d.clamp(max=20.0)) - d - 1.0


def rlsd_token_scale(teacher_logprobs: Tensor, student_logprobs: Tensor, advantage: Tensor, *, clip: float) -> Tensor:
    """RLSD's per-token size of the update, (N,) each -> (N,), detached: (p_T(a)/p_S(a))^sign(A) clipped to
    [1 − clip, 1 + clip].

    The reward decides the direction (the sign of A, the group-relative advantage); the teacher only says how
    much of it each token deserves: on a success, tokens the teacher likes more than the student get more credit;
    on a failure, tokens the teacher likes less get more of the blame. Clipped, so the teacher can never flip a
    token's sign or make one token dominate; a token of a silent group (A = 0) gets no update at all.
    """
    log_ratio = _f32(teacher_logprobs).detach() - _f32(student_logprobs).detach()
    signed = torch.sign(_f32(advantage).detach()) * log_ratio
    return torch.exp(signed.clamp(-20.0, 20.0)).clamp(1.0 - clip, 1.0 + clip)

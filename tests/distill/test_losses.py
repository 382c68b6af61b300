"""lopd_core.distill.scoring.losses on tiny tensors with values worked out by hand (seeded, fast)."""

import math

import pytest
import torch

from lopd_core.distill.scoring.losses import (
    advantages,
    anchor_loss,
    composer_loss,
    dual_ascent,
    privileged_margin_delta,
    reverse_kl_full,
    reverse_kl_sampled,
    reverse_kl_topk,
    support_kl,
    topk_support_logprobs,
    truncated_importance_weight,
)

# Hand example, V = 4: an asymmetric pair (student peaked, teacher uniform).
P_S = [0.7, 0.1, 0.1, 0.1]
P_T_UNIFORM = [0.25, 0.25, 0.25, 0.25]
# KL(p_S || p_T) = 0.7 ln(0.7/0.25) + 3 · 0.1 ln(0.1/0.25) = 0.7 · 1.029619 − 0.3 · 0.916291 = 0.445846
REVERSE_KL = 0.7 * math.log(2.8) + 0.3 * math.log(0.4)
# KL(p_T || p_S) = 0.25 ln(0.25/0.7) + 0.75 ln(0.25/0.1) = −0.257405 + 0.687218 = 0.429813
FORWARD_KL = 0.25 * math.log(0.25 / 0.7) + 0.75 * math.log(2.5)


def _logits(probs) -> torch.Tensor:
    """Logits whose softmax is `probs` (log-probs are valid logits), one row: (1, V)."""
    return torch.tensor([probs], dtype=torch.float32).log()


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return values, ids


# --- zero on equal distributions, non-negative otherwise ------------------------------------------------


def test_kls_are_zero_on_equal_distributions():
    torch.manual_seed(0)
    logits = torch.randn(6, 9) * 2
    t_lp, t_ids = _topk(logits, 3)
    assert torch.allclose(reverse_kl_topk(logits, t_lp, t_ids), torch.zeros(6), atol=1e-6)
    assert torch.allclose(reverse_kl_full(logits, logits), torch.zeros(6), atol=1e-6)
    lp = torch.log_softmax(logits, -1)[:, 0]
    assert torch.equal(reverse_kl_sampled(lp, lp), torch.zeros(6))
    s, s_tail = topk_support_logprobs(logits, t_ids)
    assert torch.allclose(support_kl(s, s_tail, s, s_tail), torch.zeros(6), atol=1e-7)


def test_kls_are_non_negative_on_random_inputs():
    torch.manual_seed(1)
    student, teacher = torch.randn(64, 12) * 3, torch.randn(64, 12) * 3
    for k in (1, 4, 12):
        t_lp, t_ids = _topk(teacher, k)
        kl = reverse_kl_topk(student, t_lp, t_ids)
        assert (kl >= -1e-6).all() and kl.max() > 0.1
    full = reverse_kl_full(student, teacher)
    assert (full >= -1e-6).all()
    # coarse-graining into K + 1 buckets never exceeds the full KL (data processing inequality)
    t_lp, t_ids = _topk(teacher, 4)
    assert (reverse_kl_topk(student, t_lp, t_ids) <= full + 1e-5).all()


# --- direction, tail, agreement -------------------------------------------------------------------------


def test_reverse_kl_topk_is_reverse_not_forward():
    student, teacher = _logits(P_S), _logits(P_T_UNIFORM)
    t_lp, t_ids = _topk(teacher, 4)  # K = V: exact
    kl = reverse_kl_topk(student, t_lp, t_ids)
    assert kl.shape == (1,)
    assert kl.item() == pytest.approx(REVERSE_KL, abs=1e-5)  # 0.445846
    assert abs(kl.item() - FORWARD_KL) > 0.01  # 0.429813: the other direction
    assert reverse_kl_full(student, teacher).item() == pytest.approx(REVERSE_KL, abs=1e-5)


def test_tail_bucket_carries_the_remaining_mass():
    # V = 4, K = 2. Student (0.7, 0.1, 0.1, 0.1), teacher (0.4, 0.3, 0.2, 0.1): teacher top-2 ids = (0, 1).
    # Student buckets (0.7, 0.1 | tail 0.2), teacher buckets (0.4, 0.3 | tail 0.3):
    # KL = 0.7 ln(0.7/0.4) + 0.1 ln(0.1/0.3) + 0.2 ln(0.2/0.3) = 0.391731 − 0.109861 − 0.081093 = 0.200777
    expected = 0.7 * math.log(0.7 / 0.4) + 0.1 * math.log(0.1 / 0.3) + 0.2 * math.log(0.2 / 0.3)
    student, teacher = _logits(P_S), _logits([0.4, 0.3, 0.2, 0.1])
    t_lp, t_ids = _topk(teacher, 2)
    assert t_ids.tolist() == [[0, 1]]
    s_support, s_tail = topk_support_logprobs(student, t_ids)
    assert s_support.exp().tolist()[0] == pytest.approx([0.7, 0.1], abs=1e-6)
    assert s_tail.exp().item() == pytest.approx(0.2, abs=1e-6)
    assert reverse_kl_topk(student, t_lp, t_ids).item() == pytest.approx(expected, abs=1e-5)
    assert expected == pytest.approx(0.200777, abs=1e-6)


def test_topk_with_k_equal_v_matches_full_and_tail_vanishes():
    torch.manual_seed(2)
    student, teacher = torch.randn(5, 7) * 2, torch.randn(5, 7) * 2
    t_lp, t_ids = _topk(teacher, 7)
    assert torch.allclose(reverse_kl_topk(student, t_lp, t_ids), reverse_kl_full(student, teacher), atol=1e-5)
    _, tail = topk_support_logprobs(student, t_ids)
    assert (tail.exp() <= 1.01e-8).all()  # clamped at the floor, no −inf


def test_reverse_kl_full_chunked_equals_unchunked_with_gradients():
    torch.manual_seed(3)
    s0, t0 = torch.randn(7, 11) * 2, torch.randn(7, 11) * 2
    results = []
    for chunk_size in (3, 1024):
        s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_()
        kl = reverse_kl_full(s, t, chunk_size=chunk_size)
        (kl * torch.arange(1.0, 8.0)).sum().backward()
        results.append((kl.detach(), s.grad, t.grad))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(reverse_kl_full(s0, t0, chunk_size=2), results[1][0], atol=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        reverse_kl_full(s0, t0, chunk_size=0)


def test_low_precision_inputs_are_upcast():
    torch.manual_seed(4)
    student, teacher = torch.randn(3, 6).bfloat16(), torch.randn(3, 6)
    t_lp, t_ids = _topk(teacher, 2)
    assert reverse_kl_topk(student, t_lp.bfloat16(), t_ids).dtype == torch.float32
    assert reverse_kl_full(student, teacher.bfloat16()).dtype == torch.float32


# --- gradient signs -------------------------------------------------------------------------------------


def test_topk_gradient_signs():
    # V = 4, K = 2 as above: buckets p_S = (0.7, 0.1, 0.2), p_T = (0.4, 0.3, 0.3), KL = 0.200777.
    # For a support logit, ∂KL/∂z_i = p_i (ln(p_i/q_i) − KL):
    #   id 0 (p_S > p_T): 0.7 (0.559616 − 0.200777) = +0.251187 -> descent lowers it;
    #   id 1 (p_S < p_T): 0.1 (−1.098612 − 0.200777) = −0.129939 -> descent raises it.
    # (The sign rule "p_S > p_T -> positive" needs ln(p_S/p_T) > KL; it always holds for the largest ratio.)
    kl = 0.200777
    student = _logits(P_S).requires_grad_()
    t_lp, t_ids = _topk(_logits([0.4, 0.3, 0.2, 0.1]), 2)
    reverse_kl_topk(student, t_lp, t_ids).sum().backward()
    grad = student.grad[0]
    assert grad[0].item() == pytest.approx(0.7 * (math.log(0.7 / 0.4) - kl), abs=1e-5)
    assert grad[1].item() == pytest.approx(0.1 * (math.log(0.1 / 0.3) - kl), abs=1e-5)
    assert grad[0] > 0 and grad[1] < 0
    assert grad.sum().item() == pytest.approx(0.0, abs=1e-6)  # softmax logits: gradient sums to 0


def test_support_kl_gradient_reaches_the_side_that_requires_it():
    torch.manual_seed(5)
    student, teacher = torch.randn(4, 8), torch.randn(4, 8).requires_grad_()
    _, t_ids = _topk(teacher.detach(), 3)
    p, p_tail = topk_support_logprobs(student, t_ids)
    q, q_tail = topk_support_logprobs(teacher, t_ids)
    support_kl(p, p_tail, q, q_tail).sum().backward()  # composer direction: KL(sg[p_S] || p_T)
    assert teacher.grad is not None and teacher.grad.abs().sum() > 0


# --- sampled estimator and importance weights -----------------------------------------------------------


def test_reverse_kl_sampled_value_and_gradient_match_exact_in_expectation():
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(5, generator=gen).requires_grad_()  # student logits, one position
    teacher_lp = torch.log_softmax(torch.randn(5, generator=gen), -1)
    exact = reverse_kl_full(z[None], teacher_lp[None])[0]
    (exact_grad,) = torch.autograd.grad(exact, z)

    samples = torch.multinomial(torch.softmax(z.detach(), -1), 200_000, replacement=True, generator=gen)
    student_lp = torch.log_softmax(z, -1)[samples]  # (M,)
    per_token = reverse_kl_sampled(student_lp, teacher_lp[samples])
    assert torch.allclose(per_token.detach(), (student_lp - teacher_lp[samples]).detach())  # value is s − t
    estimate = per_token.mean()
    (mc_grad,) = torch.autograd.grad(estimate, z)
    assert estimate.item() == pytest.approx(exact.item(), abs=0.02)
    assert torch.allclose(mc_grad, exact_grad, atol=0.03)
    assert torch.nn.functional.cosine_similarity(mc_grad, exact_grad, dim=0) > 0.99


def test_reverse_kl_sampled_gives_no_gradient_to_the_teacher():
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    t = torch.tensor([-1.5, -1.0], requires_grad=True)
    reverse_kl_sampled(s, t).sum().backward()
    assert t.grad is None
    assert s.grad.tolist() == pytest.approx([0.5, -1.0])  # sg[s − t]


def test_truncated_importance_weight_caps_and_is_detached():
    # exp(0) = 1, exp(2) = 7.389 -> capped at 2, exp(−1) = 0.367879
    s = torch.tensor([0.0, 0.0, -1.0], requires_grad=True)
    w = truncated_importance_weight(s, torch.tensor([0.0, -2.0, 0.0]), cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, math.exp(-1.0)], abs=1e-6)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weight(s, s, cap=0.0)


# --- composer -------------------------------------------------------------------------------------------


def test_advantages_all_kinds():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    # continuous: 2r − 1
    assert advantages(rewards).tolist() == pytest.approx([1.0, -1.0, 0.0, -0.5])
    successes = torch.tensor([True, False, True, False])
    assert advantages(rewards, kind="binary", successes=successes).tolist() == [1.0, -1.0, 1.0, -1.0]
    # group means: group 7 -> (1 + 0)/2 = 0.5, group 3 -> (0.5 + 0.25)/2 = 0.375
    groups = torch.tensor([7, 7, 3, 3])
    assert advantages(rewards, kind="group", group_ids=groups).tolist() == pytest.approx([0.5, -0.5, 0.125, -0.125])
    with pytest.raises(ValueError, match="'ppo'"):
        advantages(rewards, kind="ppo")
    with pytest.raises(ValueError, match="successes"):
        advantages(rewards, kind="binary")
    with pytest.raises(ValueError, match="group_ids"):
        advantages(rewards, kind="group")


def test_privileged_margin_delta_by_hand():
    # trajectory 0: tokens 0-2, A = 2; trajectory 1: no tokens; trajectory 2: tokens 3-4, A = −1.
    # gaps (teacher − old student): 0.5, −1.0, 0.0 | 1.0, 0.5
    # δ0 = 2 · (−0.5 / 3) = −1/3; δ1 = 0; δ2 = −1 · (1.5 / 2) = −0.75
    teacher = torch.tensor([-1.0, -2.0, -0.5, -0.2, -0.5], requires_grad=True)
    old = torch.tensor([-1.5, -1.0, -0.5, -1.2, -1.0], requires_grad=True)
    advantage = torch.tensor([2.0, 1.0, -1.0])
    index = torch.tensor([0, 0, 0, 2, 2])
    delta = privileged_margin_delta(teacher, old, advantage, index, 3)
    assert delta.tolist() == pytest.approx([-1 / 3, 0.0, -0.75], abs=1e-6)
    delta.sum().backward()
    # ∂δ(τ)/∂ teacher token = A(τ) / n_τ
    assert teacher.grad.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, -0.5, -0.5], abs=1e-6)
    assert old.grad is None


def test_dual_ascent_moves_beta_toward_the_constraint():
    assert dual_ascent(1.0, margin=0.1, delta_bar=0.0, lr=0.5) == pytest.approx(1.05)  # δ̄ < m: β rises
    assert dual_ascent(1.0, margin=0.1, delta_bar=0.3, lr=0.5) == pytest.approx(0.9)  # δ̄ > m: β falls
    assert dual_ascent(0.01, margin=0.1, delta_bar=1.0, lr=0.5) == 0.0  # 0.01 − 0.45 -> projected to 0


def test_anchor_loss_by_hand():
    # differences 0, 1, 2, 3 -> squares 0, 1, 4, 9 -> mean 3.5
    latents = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    anchor = torch.ones(2, 2, requires_grad=True)
    loss = anchor_loss(latents, anchor)
    assert loss.item() == pytest.approx(3.5)
    loss.backward()
    assert torch.allclose(latents.grad, torch.tensor([[0.0, 0.5], [1.0, 1.5]]))  # 2 · diff / 4
    assert anchor.grad is None
    with pytest.raises(ValueError, match="shapes"):
        anchor_loss(latents, torch.ones(4))


def test_composer_loss_composition():
    # 0.3 + 2 · (0.1 − 0.05) + 0.5 · 0.4 = 0.3 + 0.1 + 0.2 = 0.6
    kl = torch.tensor(0.3, requires_grad=True)
    delta_bar = torch.tensor(0.05, requires_grad=True)
    loss = composer_loss(kl, delta_bar, beta=2.0, margin=0.1, anchor=torch.tensor(0.4), anchor_weight=0.5)
    assert loss.item() == pytest.approx(0.6, abs=1e-6)
    loss.backward()
    assert kl.grad.item() == pytest.approx(1.0)
    assert delta_bar.grad.item() == pytest.approx(-2.0)  # −β: descent raises δ̄
    with pytest.raises(ValueError, match="scalar"):
        composer_loss(torch.zeros(3), delta_bar, beta=1.0, margin=0.0, anchor=0.0, anchor_weight=0.0)


def test_gradients_match_finite_differences():
    # float64 is kept as is, so gradcheck sees the analytic gradients, the guarded teacher tail included.
    torch.manual_seed(7)
    student = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(3, 6, dtype=torch.float64), -1)
    t_lp, t_ids = teacher.topk(3, dim=-1)
    t_lp = t_lp.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda s, t: reverse_kl_topk(s, t, t_ids), (student, t_lp))
    teacher_logits = teacher.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda s, t: reverse_kl_full(s, t, chunk_size=2), (student, teacher_logits))

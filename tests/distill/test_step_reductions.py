"""The LOPD update keeps (n, k + 1) tensors where it used to keep (n, V) ones, with the same bits:

  * the tail bucket's log-mass (losses.tail_logsumexp) against scatter + logsumexp + clamp, the formula it
    replaces: equal values and equal gradients, and autograd no longer saves the (n, V) masked copy;
  * step 4's terms from `StudentOld` and `TeacherScores`' (n, k + 1) reductions against the same terms from the
    (n, V) log-probs of both models, as the step computed them before: equal values, equal gradients;
  * `score_teacher` hands out no (n, V) tensor unless the full-vocabulary loss asks for the logits.
A whole update was compared bit for bit against the previous code in eleven configurations (see
docs/experiments/2026-12-05-performance.md); these tests pin the pieces. The old formula and the new one are two
code paths (a hand-written backward against autograd's, reductions in another order), so they are compared to
`ULPS` (a few float32 units in the last place of values of order 1-10; STYLE habit 12): on this machine they
agree to the bit, but another CPU's kernels need not, while a wrong formula (a gradient reaching the support
ids, a missing clamp) moves them by 1e-3 or more.
"""

import math

import torch

from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.teacher import action_logits, build_batch
from lopd_core.distill.update import step as S

ULPS = {"atol": 1e-6, "rtol": 1e-6}


def _old_tail(logprobs, ids):
    """The replaced formula: the masked (n, V) copy, its logsumexp, the clamp."""
    outside = logprobs.scatter(-1, ids, torch.finfo(logprobs.dtype).min)
    return torch.logsumexp(outside, dim=-1).clamp(min=math.log(L.TAIL_FLOOR))


def _logits_and_ids(n=6, v=50, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[0, :k] += 40.0  # a row whose support holds almost all the mass: the tail hits the floor
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    ids[0] = torch.arange(k)
    return logits, ids


def test_tail_logsumexp_has_the_old_values_and_gradients():
    logits, ids = _logits_and_ids()
    weights = torch.randn(logits.shape[0])
    results = []
    for tail_fn in (_old_tail, L.tail_logsumexp):
        x = logits.clone().requires_grad_(True)
        lp = torch.log_softmax(x, -1)
        tail = tail_fn(lp, ids)
        (tail * weights).sum().backward()
        results.append((tail.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], **ULPS)
    torch.testing.assert_close(results[1][1], results[0][1], **ULPS)
    assert results[1][0][0] == math.log(L.TAIL_FLOOR)  # the clamped row


def test_tail_with_every_id_in_the_support_is_the_floor_without_gradient():
    x = torch.randn(3, 4, requires_grad=True)
    ids = torch.arange(4).expand(3, 4)
    tail = L.tail_logsumexp(torch.log_softmax(x, -1), ids)
    assert torch.equal(tail.detach(), torch.full((3,), math.log(L.TAIL_FLOOR)))
    tail.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def _saved_nv(fn, shape):
    """How many distinct (n, V) buffers autograd keeps for the backward of `fn` (one tensor saved by several
    operations is one buffer)."""
    storages = set()

    def pack(t):
        if tuple(t.shape) == shape:
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return len(storages)


def test_the_student_loss_saves_one_n_by_v_tensor_fewer():
    logits, ids = _logits_and_ids()
    teacher_lp = torch.log_softmax(torch.randn(logits.shape), -1).gather(-1, ids)
    x = logits.clone().requires_grad_(True)

    def old_loss():
        lp = torch.log_softmax(x, -1)
        s_tail = _old_tail(lp, ids)
        t_tail = L._log1mexp(torch.logsumexp(teacher_lp, -1))
        return L.support_kl(lp.gather(-1, ids), s_tail, teacher_lp, t_tail)

    old = _saved_nv(old_loss, tuple(logits.shape))
    new = _saved_nv(lambda: L.reverse_kl_topk(x, teacher_lp, ids), tuple(logits.shape))
    assert (old, new) == (2, 1)  # the log-softmax alone, no longer its masked copy too
    torch.testing.assert_close(L.reverse_kl_topk(x, teacher_lp, ids), old_loss(), **ULPS)


def test_composer_terms_from_reductions_equal_the_terms_from_full_log_probs():
    teacher_logits, top_ids = _logits_and_ids(seed=1)
    student_logits, _ = _logits_and_ids(seed=2)
    n = teacher_logits.shape[0]
    action_ids = torch.randint(0, teacher_logits.shape[1], (n,), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([0, 0, 1, 1, 1, 2])
    advantage = torch.tensor([1.0, -1.0, 0.5])
    s_lp = torch.log_softmax(student_logits, -1)  # (n, V), the pre-update student, detached

    def old_terms(t_lp):
        """What step 4 computed from both models' (n, V) log-probs."""
        s_action = s_lp.gather(-1, action_ids[:, None]).squeeze(-1)
        kl = L.support_kl(
            s_lp.gather(-1, top_ids), _old_tail(s_lp, top_ids), t_lp.gather(-1, top_ids), _old_tail(t_lp, top_ids)
        )
        t_action = t_lp.gather(-1, action_ids[:, None]).squeeze(-1)
        return kl, L.privileged_margin_delta(t_action, s_action, advantage, rows, 3)

    grads = []
    for reduced in (False, True):
        x = teacher_logits.clone().requires_grad_(True)
        t_lp = torch.log_softmax(x, -1)
        if reduced:
            scores = S.TeacherScores(
                action_ids,
                rows,
                None,
                t_lp.gather(-1, top_ids),
                L.tail_logsumexp(t_lp, top_ids),
                t_lp.gather(-1, action_ids[:, None]).squeeze(-1),
                t_lp.detach().gather(-1, top_ids),
                top_ids,
                0.0,
            )
            terms = S.composer_terms(scores, S.StudentOld.of(s_lp, top_ids, action_ids), advantage)
            kl, delta = terms.kl_tokens, terms.delta
        else:
            kl, delta = old_terms(t_lp)
        (kl.sum() - 0.7 * delta.sum()).backward()
        grads.append((kl.detach(), delta.detach(), x.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **ULPS)


def test_teacher_scores_hold_no_vocabulary_sized_tensor_unless_asked(tiny_model, tiny_tokenizer):
    from _batches import six_trajectories

    _, trajs = six_trajectories(tiny_model, tiny_tokenizer)
    ids, masks = [t.token_ids for t in trajs], [t.action_mask for t in trajs]
    with torch.no_grad():
        plain = torch.log_softmax(action_logits(tiny_model, build_batch(tiny_model, ids, masks)), -1)
        scores = S.score_teacher(tiny_model, ids, masks, None, None, framing=None, share_prompt=False, top_k=5)
        kept = S.score_teacher(
            tiny_model, ids, masks, None, None, framing=None, share_prompt=False, top_k=5, keep_logits=True
        )
    vocab = plain.shape[-1]
    assert scores.logits is None and kept.logits.shape == plain.shape
    tensors = [v for v in vars(scores).values() if isinstance(v, torch.Tensor)]
    assert all(t.shape[-1] != vocab for t in tensors)
    assert torch.equal(scores.support_logprobs, plain.gather(-1, scores.topk_ids))
    assert torch.equal(scores.tail_logprob, _old_tail(plain, scores.topk_ids))
    assert scores.entropy_sum == float(-(plain.exp() * plain).sum())

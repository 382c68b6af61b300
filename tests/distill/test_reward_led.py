"""The reward-led arms (methods.py: lopd_rl_silent, lopd_rlsd, lopd_rl_annealed) against hand computations:
the silent and failed gates on a hand-built batch, RLSD's per-token scale and loss, the anneal's weight."""

import pytest
import torch

from lopd_core.distill.scoring import pg_losses as PG
from lopd_core.distill.update import anneal as AN
from lopd_core.distill.update.batch import distill_weights, group_flags
from lopd_core.distill.update.state import DistillState
from lopd_core.distill.update.step import StudentLoss, student_token_loss


def test_groups_where_the_reward_is_silent_and_where_all_failed():
    # three groups of two: (1, 0) has a signal; (1, 1) all equal (both succeeded); (0, 0) all equal, all failed
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    successes = torch.tensor([True, False, True, True, False, False])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    flat, failed = group_flags(rewards, successes, groups)
    assert flat.tolist() == [False, False, True, True, True, True]
    assert failed.tolist() == [False, False, False, False, True, True]
    assert distill_weights(flat, failed, "silent", 1.0).tolist() == [0, 0, 1, 1, 1, 1]
    assert distill_weights(flat, failed, "failed", 1.0).tolist() == [0, 0, 0, 0, 1, 1]
    assert distill_weights(flat, failed, "all", 0.25).tolist() == [0.25] * 6
    # GRPO's advantage is exactly 0 on the silent groups: that is where only the teacher can say anything
    adv = PG.group_relative_advantages(rewards, groups, eps=1e-4)
    assert adv[2:].abs().sum() == 0 and adv[:2].abs().sum() > 0


def test_rlsd_scale_takes_its_sign_from_the_reward_and_its_size_from_the_teacher():
    teacher = torch.log(torch.tensor([0.5, 0.5, 0.3, 0.1, 0.5]))
    student = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.2, 0.25]))
    advantage = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    scale = PG.rlsd_token_scale(teacher, student, advantage, clip=0.5)
    # p_T/p_S = 2 (A > 0: 2, clipped to 1.5); A < 0: (2)^-1 = 0.5 (the lower clip); 0.3/0.25 = 1.2;
    # 0.1/0.2 = 0.5, A < 0: 2 -> 1.5 (more blame where the teacher likes the token less); A = 0: 1
    torch.testing.assert_close(scale, torch.tensor([1.5, 0.5, 1.2, 1.5, 1.0]))


def test_rlsd_loss_is_the_policy_gradient_with_the_scaled_advantage():
    # one token, vocabulary of 2: the student puts 0.25 on the sampled token 0, the teacher 0.5; A = +1
    logits = torch.log(torch.tensor([[0.25, 0.75]])).requires_grad_(True)
    s_action = torch.log(torch.tensor([0.25]))

    class Targets:
        action_logprobs = torch.log(torch.tensor([0.5]))

    loss = StudentLoss("rlsd", clip=0.2, rlsd_clip=0.5)
    per_token = student_token_loss(
        logits, torch.tensor([0]), Targets, loss, pg_advantage=torch.tensor([1.0]), sample_logprobs=s_action
    )
    # ratio 1 (sampled from itself), advantage 1 × clip(2, 0.5, 1.5) = 1.5: loss −1.5
    torch.testing.assert_close(per_token.detach(), torch.tensor([-1.5]))
    per_token.sum().backward()
    # d(−1.5·log p_0)/d logits = −1.5·(onehot − p) = −1.5·(0.75, −0.75)
    torch.testing.assert_close(logits.grad, torch.tensor([[-1.125, 1.125]]))


def test_the_distillation_weight_scales_only_the_distillation_term():
    torch.manual_seed(0)
    logits = torch.randn(3, 5)
    ids = torch.tensor([0, 1, 2])

    class Targets:
        topk_logprobs = torch.log_softmax(torch.randn(3, 5), -1)[:, :2]
        topk_ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
        action_logprobs = torch.zeros(3)

    common = {
        "pg_advantage": torch.tensor([1.0, -1.0, 0.5]),
        "sample_logprobs": torch.log_softmax(logits, -1)[[0, 1, 2], ids],
    }
    pg_only = student_token_loss(logits, ids, Targets, StudentLoss("grpo"), **common)
    kl_only = student_token_loss(logits, ids, Targets, StudentLoss("topk"))
    mixed = student_token_loss(
        logits, ids, Targets, StudentLoss("topk", rl_weight=2.0), distill_weight=torch.tensor([1.0, 0.0, 0.5]), **common
    )
    torch.testing.assert_close(mixed, kl_only * torch.tensor([1.0, 0.0, 0.5]) + 2.0 * pg_only)


@pytest.mark.parametrize(
    ("teacher", "recent", "want"),
    [(0.4, [0.1, 0.3], 0.5), (0.4, [0.5], 0.0), (None, [0.3], 1.0), (0.0, [0.1], 0.0), (0.4, [], 1.0)],
)
def test_the_anneal_weight_is_one_minus_the_student_over_the_teacher(teacher, recent, want):
    assert AN.anneal_scale(teacher, recent) == pytest.approx(want)


def test_the_anneal_keeps_a_window_of_the_student_s_own_batches():
    class T:
        def __init__(self, ok):
            self.success = ok

    state = DistillState(teacher_level=0.5)
    assert AN.step_scale(0, state, [T(True)]) == 1.0 and state.recent_success == []  # no anneal: untouched
    assert AN.step_scale(2, state, [T(True), T(False), T(False), T(False)]) == pytest.approx(1 - 0.25 / 0.5)
    # window [0.25, 1.0]: the student's level 0.625 is past the teacher's 0.5, the weight clips at 0
    assert AN.step_scale(2, state, [T(True), T(True)]) == 0.0
    assert state.recent_success == [0.25, 1.0] and state.distill_scale == 0.0
    # the window drops 0.25: [1.0, 0.25] -> level 0.625 again; then [0.25, 0.0] -> 0.125: weight 1 − 0.125/0.5
    assert AN.step_scale(2, state, [T(True), T(False), T(False), T(False)]) == 0.0
    assert AN.step_scale(2, state, [T(False)] * 4) == pytest.approx(0.75)

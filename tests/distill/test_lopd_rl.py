"""`lopd_rl`, the hybrid beyond the paper: LOPD's distillation loss plus `baselines.rl_weight` times the GRPO
term, on the same rollouts and tokens (lopd_core/distill/update/step.py student_token_loss)."""

from __future__ import annotations

import torch

from lopd_core.config import Params, load_params
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring import pg_losses as PG
from lopd_core.distill.update import step as S
from lopd_core.methods import resolve_method


def _loss(method: str, rl_weight: float = 1.0) -> S.StudentLoss:
    params = Params()
    lopd = type(params.lopd)(**{**params.lopd.__dict__, "method": method})
    baselines = type(params.baselines)(**{**params.baselines.__dict__, "rl_weight": rl_weight})
    return S.StudentLoss.resolve(resolve_method(lopd, baselines), lopd, baselines)


def test_lopd_rl_is_lopds_loss_plus_the_weighted_grpo_term():
    torch.manual_seed(0)
    n, v, k = 6, 11, 4
    logits = torch.randn(n, v)
    actions = torch.randint(0, v, (n,))
    teacher = torch.log_softmax(torch.randn(n, v), -1)
    top = teacher.topk(k, -1)
    targets = S.StudentTargets(top.values, top.indices, teacher.gather(-1, actions[:, None]).squeeze(-1))
    sample_lp = torch.log_softmax(torch.randn(n, v), -1).gather(-1, actions[:, None]).squeeze(-1)
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, 2.0, 0.0])
    hybrid = _loss("lopd_rl", rl_weight=0.3)
    assert hybrid.kind == "topk" and hybrid.rl_weight == 0.3 and hybrid.reads_sample_logprobs
    got = S.student_token_loss(logits, actions, targets, hybrid, pg_advantage=adv, sample_logprobs=sample_lp)
    s_action = torch.log_softmax(logits, -1).gather(-1, actions[:, None]).squeeze(-1)
    want = L.reverse_kl_topk(logits, top.values, top.indices) + 0.3 * PG.clipped_policy_loss(
        s_action, sample_lp, adv, clip=hybrid.clip
    )
    torch.testing.assert_close(got, want)
    lopd = _loss("lopd")
    assert lopd.rl_weight == 0 and not lopd.reads_sample_logprobs  # plain LOPD is untouched


def test_lopd_rl_is_a_method_of_the_one_loop_with_its_weight_in_baselines():
    params = load_params("params.yaml", ["lopd.method=lopd_rl", "baselines.rl_weight=0.5"])
    spec = resolve_method(params.lopd, params.baselines)
    assert spec.teacher.context == "latent" and spec.composer.trainable and spec.uses_bank
    assert params.baselines.rl_weight == 0.5

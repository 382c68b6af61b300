"""Scoring with each shared prompt run once (lopd_core/distill/scoring/prefix.py) against scoring every row from its
first token (teacher.build_batch + action_logits): same logits at the same action tokens in the same order, and the
same gradient reaching the latents — while the prompt runs once per task, not once per sample."""

import torch

from lopd_core.distill.scoring.prefix import score_actions_shared
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout


def _trajectories(model, tokenizer, tasks: int, samples: int):
    reqs = [
        RolloutRequest(t, sample_index=g)
        for t in make_tasks("toolworld", "train", tasks, seed=5)
        for g in range(samples)
    ]
    trajs = rollout(
        model,
        ChatCodec(tokenizer),
        reqs,
        sampling=Sampling(temperature=1.0, max_new_tokens=16, max_context=640),
        seed=2,
    )
    return [t.token_ids for t in trajs], [t.action_mask for t in trajs]


def test_shared_prompt_scores_equal_per_row_scores_and_gradients(tiny_model, tiny_tokenizer):
    ids, masks = _trajectories(tiny_model, tiny_tokenizer, tasks=3, samples=3)
    assert len({len(i) for i in ids}) > 1  # rows of different lengths: the padding is exercised
    framing = Framing.from_tokenizer(tiny_tokenizer)
    width = tiny_model.config.hidden_size
    torch.manual_seed(0)
    latents = [torch.randn(6, width, requires_grad=True) for _ in range(3)]  # one block per task
    context = [latents[i // 3] for i in range(len(ids))]
    model = tiny_model.eval()

    batch = build_batch(model, ids, masks, context, framing)
    plain = action_logits(model, batch)
    shared = score_actions_shared(
        model, ids, masks, context=context, framing=framing, context_keys=[i // 3 for i in range(len(ids))]
    )
    assert shared.prompts == 3
    assert torch.equal(shared.action_ids, batch.action_ids)
    assert torch.equal(shared.token_traj_index, batch.token_traj_index)
    torch.testing.assert_close(shared.logits, plain, atol=1e-4, rtol=1e-4)

    probe = torch.randn(plain.shape[-1])  # any scalar function of every logit
    g_plain = torch.autograd.grad((torch.log_softmax(plain, -1) * probe).sum(), latents)
    g_shared = torch.autograd.grad((torch.log_softmax(shared.logits, -1) * probe).sum(), latents)
    for a, b in zip(g_plain, g_shared):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


def test_rows_without_context_share_by_prompt_ids_alone(tiny_model, tiny_tokenizer):
    ids, masks = _trajectories(tiny_model, tiny_tokenizer, tasks=2, samples=2)
    model = tiny_model.eval()
    with torch.no_grad():
        plain = action_logits(model, build_batch(model, ids, masks))
        shared = score_actions_shared(model, ids, masks)
    assert shared.prompts == 2
    torch.testing.assert_close(shared.logits, plain, atol=1e-4, rtol=1e-4)


def test_different_contexts_never_share_a_prompt(tiny_model, tiny_tokenizer):
    """Two samples of one task reading different contexts (SDPO's siblings) are two prompts."""
    ids, masks = _trajectories(tiny_model, tiny_tokenizer, tasks=1, samples=2)
    framing = Framing.from_tokenizer(tiny_tokenizer)
    torch.manual_seed(1)
    context = [torch.randn(4, tiny_model.config.hidden_size) for _ in range(2)]
    model = tiny_model.eval()
    with torch.no_grad():
        plain = action_logits(model, build_batch(model, ids, masks, context, framing))
        shared = score_actions_shared(model, ids, masks, context=context, framing=framing, context_keys=["a", "b"])
    assert shared.prompts == 2
    torch.testing.assert_close(shared.logits, plain, atol=1e-4, rtol=1e-4)

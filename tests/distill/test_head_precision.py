"""The LM head in float32 for a bf16 model (lopd_core/model/head.py), where training reads log-probs: scoring
(teacher.action_logits, prefix.score_actions_shared) and the rollout's sampling log-probs (engine).

Tolerances, and why:
  * a float32 model: bit-identical to its own head (torch.equal);
  * the head matmul of bf16 hidden states and weights: within 1e-4 of a float64 matmul of the same bf16 values
    (float32 products summed over D = 32: error ~1e-6 at logits of ~20), where the bf16 head is off by up to
    half a bf16 step (1/16 at |logit| ≥ 16), so the test also asserts it is at least 100× worse;
  * a bf16 model against its float32 twin: action log-probs within 0.05 (the bf16 body's own rounding, which
    no head fixes; the float32 head's mean error is below the bf16 head's).
"""

import copy
from unittest import mock

import torch

from lopd_core.distill.scoring.prefix import score_actions_shared
from lopd_core.distill.scoring.teacher import action_logits, build_batch
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.head import head_logits, uses_float32_head
from lopd_core.rollout.engine import RolloutRequest, Sampling, generate_turn, rollout


def _sharp_copy(model, dtype=torch.float32, scale=12.0):
    """A copy with larger logits (a trained LM's range, where bf16 rounding of a logit is large); at the default
    scale, sampled tokens still have log-probs of a few nats, so their errors show."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(scale)  # tied to the input embeddings: the body's inputs scale too
    return sharp.to(dtype).eval()


def _rollouts(model, tokenizer, n=2, samples=2):
    reqs = [
        RolloutRequest(t, sample_index=g) for t in make_tasks("toolworld", "train", n, seed=5) for g in range(samples)
    ]
    trajs = rollout(
        model,
        ChatCodec(tokenizer),
        reqs,
        sampling=Sampling(temperature=1.0, max_new_tokens=10, max_context=640),
        seed=1,
    )
    return [t.token_ids for t in trajs], [t.action_mask for t in trajs], trajs


def _action_logprobs(logits, action_ids):
    return torch.log_softmax(logits, -1).gather(-1, action_ids[:, None]).squeeze(-1)  # (N,)


def test_float32_model_keeps_its_own_head_bit_for_bit(tiny_model, tiny_tokenizer):
    model = tiny_model.eval()
    assert uses_float32_head(model)
    hidden = torch.randn(7, model.config.hidden_size)
    assert torch.equal(head_logits(model, hidden), model.lm_head(hidden))
    ids, masks, _ = _rollouts(model, tiny_tokenizer)
    batch = build_batch(model, ids, masks)
    with torch.no_grad():
        states = model.model(inputs_embeds=batch.inputs_embeds, attention_mask=batch.attention_mask)
        before = model.lm_head(states.last_hidden_state[batch.predict_rows, batch.predict_cols]).float()
        assert torch.equal(action_logits(model, batch), before)


def test_bf16_head_matmul_is_float32_accurate(tiny_model):
    model = _sharp_copy(tiny_model, torch.bfloat16, scale=40.0)
    assert not uses_float32_head(model)
    torch.manual_seed(0)
    hidden = torch.randn(64, model.config.hidden_size).to(torch.bfloat16)  # what a bf16 body hands the head
    exact = hidden.double() @ model.lm_head.weight.double().T  # (64, V) of the same bf16 values
    assert exact.abs().max() > 16
    ours = head_logits(model, hidden)
    assert ours.dtype == torch.float32
    ours_err = (ours.double() - exact).abs().max().item()
    bf16_err = (model.lm_head(hidden).double() - exact).abs().max().item()
    assert ours_err < 1e-4
    assert bf16_err > 100 * ours_err
    torch.testing.assert_close(torch.log_softmax(ours.double(), -1), torch.log_softmax(exact, -1), atol=1e-4, rtol=0)


def test_bf16_model_scores_near_its_float32_twin(tiny_model, tiny_tokenizer):
    full = _sharp_copy(tiny_model)
    half = _sharp_copy(tiny_model, torch.bfloat16)
    ids, masks, _ = _rollouts(full, tiny_tokenizer)
    with torch.no_grad():
        ref_batch = build_batch(full, ids, masks)
        ref = _action_logprobs(action_logits(full, ref_batch), ref_batch.action_ids)
        half_batch = build_batch(half, ids, masks)
        plain = action_logits(half, half_batch)
        shared = score_actions_shared(half, ids, masks)
        states = half.model(inputs_embeds=half_batch.inputs_embeds, attention_mask=half_batch.attention_mask)
        bf16_head = half.lm_head(states.last_hidden_state[half_batch.predict_rows, half_batch.predict_cols])
    assert plain.dtype == shared.logits.dtype == torch.float32
    err = (_action_logprobs(plain, half_batch.action_ids) - ref).abs()
    assert err.max() < 0.05
    assert (_action_logprobs(shared.logits, shared.action_ids) - ref).abs().max() < 0.05
    # what remains is the body's rounding: the bf16 head adds its own on top
    assert err.mean() < (_action_logprobs(bf16_head.float(), half_batch.action_ids) - ref).abs().mean()


def test_bf16_rollout_samples_with_the_float32_head(tiny_model, tiny_tokenizer):
    """The first sampled token's log-prob is the one scoring gives it (same context, same body ops, one row):
    with a bf16 head, rollout and training would each round the logits on their own."""
    half = _sharp_copy(tiny_model, torch.bfloat16)
    codec = ChatCodec(tiny_tokenizer)
    ids, _, trajs = _rollouts(half, tiny_tokenizer, n=1, samples=1)
    prompt = ids[0][: trajs[0].prompt_length]
    with mock.patch.object(half.lm_head, "forward", side_effect=AssertionError("bf16 head used")):
        [(turn_ids, turn_lps)] = generate_turn(
            half,
            [prompt],
            sampling=Sampling(temperature=0.0, max_new_tokens=1),
            stop_id=codec.im_end_id,
            pad_id=codec.pad_id,
            generator=torch.Generator().manual_seed(0),
        )
    with torch.no_grad():
        batch = build_batch(half, [prompt + turn_ids], [[0] * len(prompt) + [1]])
        scored = _action_logprobs(action_logits(half, batch), batch.action_ids)
    assert abs(turn_lps[0] - float(scored[0])) < 1e-5

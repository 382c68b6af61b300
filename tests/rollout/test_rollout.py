"""Rollout engine: trajectories are what the policy saw and sampled, token for token."""

import pytest
import torch
from _float_paths import assert_same_greedy_play

from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
from lopd_core.rollout.table import read_trajectories, trajectories_to_frame, write_trajectories

SAMPLED = Sampling(temperature=1.0, max_new_tokens=24, max_context=512)


@pytest.fixture(scope="module")
def tasks():
    return make_tasks("toolworld", "test_id", 6, seed=5)


@pytest.fixture(scope="module")
def sampled(tiny_model, tiny_tokenizer, tasks):
    codec = ChatCodec(tiny_tokenizer)
    requests = [RolloutRequest(t, sample_index=i % 2) for i, t in enumerate(tasks)]
    return rollout(tiny_model, codec, requests, sampling=SAMPLED, batch_size=4, seed=11)


def _action_runs(traj):
    """Contiguous runs of policy tokens: one per assistant turn."""
    runs, current = [], []
    for tok, m in zip(traj.token_ids, traj.action_mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def test_smoke_every_trajectory_finishes_and_validates(sampled, tmp_path):
    assert len(sampled) == 6
    for t in sampled:
        assert t.stop_reason in {"answer", "turn_limit", "context_limit"}
        assert 0.0 <= t.reward <= 1.0
        assert t.num_turns >= 1 and t.num_action_tokens > 0
        assert t.token_ids[: t.prompt_length] and not any(t.action_mask[: t.prompt_length])
    frame = trajectories_to_frame(sampled)
    back = read_trajectories(write_trajectories(frame, tmp_path / "t.parquet"))
    assert back["token_ids"].tolist() == [t.token_ids for t in sampled]


def test_action_mask_selects_exactly_the_policy_tokens(sampled, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    for t in sampled:
        runs = _action_runs(t)
        assert len(runs) == t.num_turns
        # Each run decodes to the action the environment received: the policy's tokens and nothing else.
        for run, record in zip(runs, t.episode):
            assert codec.decode_action(run) == record["action"]
        # Forced tokens never carry a sampling log-prob; sampled ones always do (< 0 up to rounding).
        for m, lp in zip(t.action_mask, t.sample_logprobs):
            assert (lp == 0.0) if not m else (lp <= 0.0)


def test_sample_logprobs_match_a_full_forward_pass(sampled, tiny_model):
    # Rows of different lengths were left-padded and decoded through the KV cache; the recorded log-probs must
    # equal a plain forward over the finished sequence — this catches padding or position-id mistakes.
    for t in sampled[:3]:
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / SAMPLED.temperature, dim=-1)
        targets = ids[0, 1:]
        mask = torch.tensor(t.action_mask[1:], dtype=torch.bool)
        expected = logprobs.gather(-1, targets[:, None]).squeeze(-1)[mask]
        recorded = torch.tensor(t.sample_logprobs[1:])[mask]
        torch.testing.assert_close(recorded, expected, atol=2e-4, rtol=1e-4)


def test_generation_is_deterministic_per_seed(tiny_model, tiny_tokenizer, tasks):
    codec = ChatCodec(tiny_tokenizer)
    requests = [RolloutRequest(t) for t in tasks[:3]]
    a = rollout(tiny_model, codec, requests, sampling=SAMPLED, batch_size=3, seed=1)
    b = rollout(tiny_model, codec, requests, sampling=SAMPLED, batch_size=3, seed=1)
    c = rollout(tiny_model, codec, requests, sampling=SAMPLED, batch_size=3, seed=2)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.token_ids for t in a] != [t.token_ids for t in c]


def test_greedy_ignores_seed_and_top_p_truncates(tiny_model, tiny_tokenizer, tasks):
    codec = ChatCodec(tiny_tokenizer)
    greedy = Sampling(temperature=0.0, max_new_tokens=16, max_context=512)
    requests = [RolloutRequest(t) for t in tasks[:2]]
    a = rollout(tiny_model, codec, requests, sampling=greedy, batch_size=2, seed=1)
    b = rollout(tiny_model, codec, requests, sampling=greedy, batch_size=1, seed=9)
    # Batching and seed change nothing. A batch of two and a row alone are two float paths (padding, matmul
    # shapes), so the ids are compared where the greedy choice is clear: up to any top-2 margin within 1e-3,
    # log-probs to 1e-4 (tests/_float_paths.py).
    assert_same_greedy_play(tiny_model, a, b)
    nucleus = Sampling(temperature=1.0, top_p=1e-6, max_new_tokens=16, max_context=512)
    c = rollout(tiny_model, codec, requests, sampling=nucleus, batch_size=2, seed=3)
    # A tiny nucleus keeps only the top token, so sampling collapses to greedy with log-prob 0.
    assert [t.token_ids for t in c] == [t.token_ids for t in a]
    assert all(lp == 0.0 for t in c for lp in t.sample_logprobs)


def test_experiences_sit_in_the_first_user_turn(tiny_model, tiny_tokenizer, tasks):
    codec = ChatCodec(tiny_tokenizer)
    req = RolloutRequest(tasks[0], experiences=("an earlier success",))
    (t,) = rollout(tiny_model, codec, [req], sampling=SAMPLED, seed=0)
    prompt = tiny_tokenizer.decode(t.token_ids[: t.prompt_length])
    assert "<|exp_start|>an earlier success<|exp_end|>" in prompt
    assert prompt.index("<|exp_end|>") < prompt.index(tasks[0].instruction)

"""Keeping each trajectory's KV cache across turns (rollout's `keep_cache`, engine._KeptCache) plays what
re-prefilling every conversation each turn plays (`keep_cache=False`, the reference): same ids, same action
masks, sampling log-probs equal to 1e-5, greedy and sampled, with one stream for the batch and one per row,
with trajectories ending at different turns, at the context limit, and with a latent teacher's input embeddings.

The kept cache computes a later turn's logits in another order than a full prefill (the new tokens against
cached keys, pad slots inside the sequence), so log-probs differ by float noise: at most about 1e-6 here.
Equal ids then rest on no sampled or greedy choice sitting within that noise of a tie; with these fixed seeds,
models and tasks none does (a change of seed could in principle meet one, and the ids would then part).

The shared tiny model answers every prompt in one turn, so these tests give it a biased head: the policy then
often opens a tool call (which, unclosed, is an error observation and another turn) and often ends its turn
itself, so rows run different numbers of turns of different lengths and leave the batch at different rounds.
"""

import copy
from functools import wraps
from unittest import mock

import pytest
import torch

from lopd_core.distill.teacher import Framing, embed_row
from lopd_core.envs import make_tasks
from lopd_core.envs.toolworld.tools import CALL_OPEN
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

GREEDY = Sampling(temperature=0.0, max_new_tokens=12, max_context=768)
SAMPLED = Sampling(temperature=1.0, top_p=0.9, max_new_tokens=12, max_context=768)


@pytest.fixture(scope="module")
def caller(tiny_model, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    model = copy.deepcopy(tiny_model)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[codec.im_end_id], head.bias[codec.encode(CALL_OPEN)[0]] = 3.0, 5.0
    model.lm_head = head
    return model.eval()


def _requests(tasks: int, samples: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(t, sample_index=g)
        for t in make_tasks("toolworld", "train", tasks, seed=7)
        for g in range(samples)
    ]


def _both(model, codec, requests, sampling, *, per_row: bool, batch_size: int | None = None, **kwargs):
    seeds = [100 + i for i in range(len(requests))] if per_row else None
    return [
        rollout(
            model,
            codec,
            requests,
            sampling=sampling,
            batch_size=batch_size or len(requests),
            seed=3,
            seeds=seeds,
            keep_cache=keep,
            **kwargs,
        )
        for keep in (True, False)
    ]


def _assert_same_play(kept, plain):
    assert [t.token_ids for t in kept] == [t.token_ids for t in plain]
    assert [t.action_mask for t in kept] == [t.action_mask for t in plain]
    assert [(t.reward, t.stop_reason, t.num_turns) for t in kept] == [
        (t.reward, t.stop_reason, t.num_turns) for t in plain
    ]
    for a, b in zip(kept, plain):
        torch.testing.assert_close(torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("per_row", [False, True], ids=["batch-stream", "row-streams"])
def test_kept_cache_plays_what_re_prefill_plays(caller, tiny_tokenizer, sampling, per_row):
    codec = ChatCodec(tiny_tokenizer)
    kept, plain = _both(caller, codec, _requests(tasks=3, samples=4), sampling, per_row=per_row)
    _assert_same_play(kept, plain)
    assert max(t.num_turns for t in kept) >= 4  # later turns ran on the kept cache
    if sampling.temperature > 0:  # rows left the batch at different rounds: the cache dropped rows
        assert len({t.num_turns for t in kept}) > 1


def test_context_limit_and_several_batches(caller, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    sampling = Sampling(temperature=1.0, max_new_tokens=12, max_context=200)
    kept, plain = _both(caller, codec, _requests(tasks=3, samples=3), sampling, per_row=True, batch_size=4)
    _assert_same_play(kept, plain)
    assert "context_limit" in {t.stop_reason for t in kept}


def test_input_embeddings_of_a_latent_teacher(caller, tiny_tokenizer):
    """Latents spliced into the first user turn: later turns feed the tail of the embedder's output."""
    codec = ChatCodec(tiny_tokenizer)
    framing = Framing.from_tokenizer(tiny_tokenizer)
    embed = caller.get_input_embeddings()
    requests = _requests(tasks=2, samples=3)
    gen = torch.Generator().manual_seed(0)
    latents = [torch.randn(5, caller.config.hidden_size, generator=gen) * 0.3 for _ in requests]

    def embedder(index, ids):
        return embed_row(embed, ids, latents[index], framing)[0]

    kept, plain = _both(caller, codec, requests, SAMPLED, per_row=True, context_embedder=embedder)
    _assert_same_play(kept, plain)
    assert max(t.num_turns for t in kept) >= 4
    by_ids = rollout(caller, codec, requests, sampling=SAMPLED, seed=3, seeds=[100 + i for i in range(6)])
    assert [t.token_ids for t in kept] != [t.token_ids for t in by_ids]  # the latents did change the play


def test_later_turns_prefill_only_their_new_tokens(caller, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    requests = _requests(tasks=2, samples=2)
    widths = []
    forward = caller.forward

    @wraps(forward)  # keeps the signature the engine inspects for its cache keyword
    def recording(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    with mock.patch.object(caller, "forward", recording):
        trajs = rollout(caller, codec, requests, sampling=GREEDY, batch_size=4, keep_cache=True)
    prefills = [w for w in widths if w > 1]
    assert len(prefills) == max(t.num_turns for t in trajs)  # one prefill per round
    assert prefills[0] >= min(t.prompt_length for t in trajs)
    assert all(w < min(t.prompt_length for t in trajs) for w in prefills[1:])  # not the whole conversation

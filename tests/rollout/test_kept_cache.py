"""Keeping each trajectory's KV cache across turns (rollout's `keep_cache`, engine._KeptCache) computes what a
full forward pass computes, and so plays what re-prefilling every conversation each turn plays
(`keep_cache=False`, the reference): greedy and sampled, with one stream for the batch and one per row, with
trajectories ending at different turns, at the context limit, and with a latent teacher's input embeddings.

The kept cache computes a later turn's logits in another order than a full prefill (the new tokens against
cached keys, pad slots inside the sequence), so its logits differ by float noise (about 1e-6 here), and how
much depends on the CPU's kernels. So nothing here compares a sampled token or a bit across the two paths
(STYLE habit 12; tests/_float_paths.py states the tolerances):
  * teacher-forced, both paths: every sampled token's recorded log-prob equals a full forward pass's over the
    finished trajectory, under the same (temperature, top_p) truncation, to 1e-4;
  * greedy: the kept play's ids equal the re-prefill's up to the first action token whose top-2 margin is within
    1e-3 (none is, with these seeds: the smallest margin is about 1.8).
A wrong cache fails the first check: `test_a_wrong_cache_fails_the_teacher_forced_check` corrupts it two ways.

The shared tiny model answers every prompt in one turn, so these tests give it a biased head: the policy then
often opens a tool call (which, unclosed, is an error observation and another turn) and often ends its turn
itself, so rows run different numbers of turns of different lengths and leave the batch at different rounds.
"""

import copy
from functools import wraps
from unittest import mock

import pytest
import torch
from _float_paths import assert_records_full_forward, assert_same_play

from lopd_core.distill.scoring.teacher import Framing, embed_row
from lopd_core.envs import make_tasks
from lopd_core.envs.toolworld.tools import CALL_OPEN
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
from lopd_core.rollout.kept_cache import _KeptCache

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


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("per_row", [False, True], ids=["batch-stream", "row-streams"])
def test_kept_cache_plays_what_re_prefill_plays(caller, tiny_tokenizer, sampling, per_row):
    codec = ChatCodec(tiny_tokenizer)
    kept, plain = _both(caller, codec, _requests(tasks=3, samples=4), sampling, per_row=per_row)
    assert_same_play(caller, kept, plain, sampling)
    assert max(t.num_turns for t in kept) >= 4  # later turns ran on the kept cache
    if sampling.temperature > 0:  # rows left the batch at different rounds: the cache dropped rows
        assert len({t.num_turns for t in kept}) > 1


def test_context_limit_and_several_batches(caller, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    sampling = Sampling(temperature=1.0, max_new_tokens=12, max_context=200)
    kept, plain = _both(caller, codec, _requests(tasks=3, samples=3), sampling, per_row=True, batch_size=4)
    assert_same_play(caller, kept, plain, sampling)
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
    assert_same_play(caller, kept, plain, SAMPLED, latents, framing)  # re-scored with the latents spliced
    assert max(t.num_turns for t in kept) >= 4
    # The latents did change the play: re-scored without them, the recorded log-probs are far outside the
    # tolerance, so the check above could tell a kept cache that dropped the latents (or read them twice).
    with pytest.raises(AssertionError, match="not close"):  # the log-prob comparison itself fails
        assert_records_full_forward(caller, kept, SAMPLED)


def _positions_one_late(next_turn):
    def corrupted(self, contexts, context_embeds):
        self.next_pos = [p + 1 for p in self.next_pos]  # a gap in every row's positions
        return next_turn(self, contexts, context_embeds)

    return corrupted


def _rows_mixed_up(keep_rows):
    def corrupted(self, rows):
        return keep_rows(self, list(range(len(rows))))  # the first rows' caches stay, whoever played on

    return corrupted


@pytest.mark.parametrize(
    ("method", "corrupt"),
    [("next_turn", _positions_one_late), ("keep_rows", _rows_mixed_up)],
    ids=["positions-one-late", "rows-mixed-up"],
)
def test_a_wrong_cache_fails_the_teacher_forced_check(caller, tiny_tokenizer, method, corrupt):
    """The tolerance is no blindfold: a kept cache that is wrong in a later turn moves the recorded log-probs by
    about 3e-2 against the full pass (measured), far outside 1e-4, so the check of the tests above fails."""
    codec = ChatCodec(tiny_tokenizer)
    requests = _requests(tasks=3, samples=4)
    with mock.patch.object(_KeptCache, method, corrupt(getattr(_KeptCache, method))):
        kept = rollout(
            caller,
            codec,
            requests,
            sampling=SAMPLED,
            batch_size=len(requests),
            seed=3,
            seeds=[100 + i for i in range(len(requests))],
        )
    assert max(t.num_turns for t in kept) >= 2  # the corrupted part ran
    with pytest.raises(AssertionError, match="not close"):  # the log-prob comparison itself fails
        assert_records_full_forward(caller, kept, SAMPLED)


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

"""Continuous batching (lopd_core/rollout/continuous.py) decodes what `generate_turn` decodes for each request
alone: requests join a running batch at different steps with different contexts, temperatures and lengths,
leave it when done; the cache never grows past twice its longest row, and rows that leave and join in turn reuse
the cache's rows instead of gathering the whole cache for every event.

The batch and a request alone are two float paths (other rows, other padding in the matmuls), so they are
compared by what must be equal (STYLE habit 12, tests/_float_paths.py), never by a sampled token: both record
the log-probs of one full forward pass to 1e-4, and each request's tokens are what its own stream picks from
that pass's distribution (greedy: its argmax) up to the first draw within 1e-5 of an edge (greedy: a top-2
margin within 1e-3). With these seeds no draw is near an edge, and the test asserts most tokens were checked."""

import pytest
import torch
from _float_paths import check_recorded_logprobs, check_stream_picks

from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.continuous import ContinuousBatch, Request
from lopd_core.rollout.decode import generate_turn
from lopd_core.rollout.trajectory import Sampling

TEXTS = ("hello there", "what is the weather in the city today", "count", "find key a in the table please")
# (temperature, top_p, max_tokens, the step it joins at)
SETTINGS = [(1.0, 1.0, 9, 0), (0.0, 1.0, 6, 0), (0.7, 0.9, 12, 2), (1.0, 1.0, 5, 4)]


def _alone(model, chat, context, temperature, top_p, max_tokens, seed):
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens)
    [(ids, lps)] = generate_turn(
        model,
        [context],
        sampling=sampling,
        stop_id=chat.im_end_id,
        pad_id=chat.pad_id,
        generator=[torch.Generator().manual_seed(seed)],
    )
    return ids, lps


def _check_turn(model, context, turn, logprobs, sampling):
    """The turn's recorded log-probs are a full forward pass's under its sampling, to 1e-4."""
    mask = [0] * len(context) + [1] * len(turn)
    check_recorded_logprobs(model, context + turn, mask, [0.0] * len(context) + list(logprobs), sampling)


@pytest.mark.parametrize("seed", [0, 2])
def test_requests_joining_and_leaving_decode_what_they_decode_alone(tiny_model, tiny_tokenizer, seed):
    chat = ChatCodec(tiny_tokenizer)
    model = tiny_model.eval()
    contexts = [chat.start("", text).token_ids for text in TEXTS]
    batch = ContinuousBatch(model, stop_id=chat.im_end_id, pad_id=chat.pad_id)
    requests = [
        Request(c, t, p, n, torch.Generator().manual_seed(seed * 10 + k))
        for k, (c, (t, p, n, _)) in enumerate(zip(contexts, SETTINGS))
    ]
    finished, step = [], 0
    while len(finished) < len(requests):
        for request, (_, _, _, joins) in zip(requests, SETTINGS):
            if joins == step:
                batch.add(request)
        if len(batch):
            finished += batch.step()
            own = [len(r.context) + len(r.ids) for r in batch.requests()]
            assert batch.attention is None or batch.attention.shape[1] <= 2 * max(own, default=1)
        step += 1
    assert len(batch) == 0
    checked = total = 0
    for k, (request, (t, p, n, _)) in enumerate(zip(requests, SETTINGS)):
        sampling = Sampling(temperature=t, top_p=p, max_new_tokens=n)
        ids, lps = _alone(model, chat, contexts[k], t, p, n, seed * 10 + k)
        for turn, logprobs in ((request.ids, request.logprobs), (ids, lps)):  # the batch's, then alone
            _check_turn(model, contexts[k], turn, logprobs, sampling)
            checked += check_stream_picks(model, contexts[k], turn, sampling, seed * 10 + k)
            total += len(turn)
    # The check stops at a turn's first draw near an edge; where that falls is the fixture model's (conftest), not
    # the batch's: the seeds are ones whose draws stay clear of edges with this fixture (seed 1 met one early once
    # the fixture's named-world demonstrations changed with val and test_final).
    assert checked >= 0.9 * total


def test_a_rebuilt_batch_goes_on_from_the_ids_it_kept(tiny_model, tiny_tokenizer):
    chat = ChatCodec(tiny_tokenizer)
    contexts = [chat.start("", text).token_ids for text in TEXTS[:2]]
    batch = ContinuousBatch(tiny_model.eval(), stop_id=chat.im_end_id, pad_id=chat.pad_id)
    requests = [Request(c, 1.0, 1.0, 8, torch.Generator().manual_seed(k)) for k, c in enumerate(contexts)]
    for request in requests:
        batch.add(request)
    for _ in range(3):
        batch.step()
    batch.rebuild()  # as after a failed step: the cache from the ids, the streams where they were
    while len(batch):
        batch.step()
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8)
    checked = 0
    for k, request in enumerate(requests):  # the rebuilt cache and the streams go on as a request alone would
        _check_turn(tiny_model, contexts[k], request.ids, request.logprobs, sampling)
        checked += check_stream_picks(tiny_model, contexts[k], request.ids, sampling, k)
    assert checked >= 0.9 * sum(len(r.ids) for r in requests)


def test_rows_that_leave_and_join_in_turn_reuse_the_cache_rows(tiny_model, tiny_tokenizer):
    """A server's steady state: whenever a request finishes, the next one joins. Every event used to gather the
    whole cache; now a joiner takes the row its predecessor freed, and a gather comes only once the masked share
    is large, so there are far fewer gathers than joins and leaves, and each request still decodes what it
    decodes alone."""
    chat = ChatCodec(tiny_tokenizer)
    model = tiny_model.eval()
    contexts = [chat.start("", TEXTS[k % len(TEXTS)]).token_ids for k in range(12)]
    requests = [Request(c, 1.0, 1.0, 3 + k % 5, torch.Generator().manual_seed(k)) for k, c in enumerate(contexts)]
    batch = ContinuousBatch(model, stop_id=chat.im_end_id, pad_id=chat.pad_id)
    waiting = list(requests)
    for _ in range(4):
        batch.add(waiting.pop(0))
    events = 4
    while len(batch):
        for _ in batch.step():
            events += 1  # a leave
            if waiting:
                batch.add(waiting.pop(0))
                events += 1  # a join
        assert len(batch.rows) <= 4  # every joiner took a freed row: the cache never widened in rows
    assert batch.compactions < events / 2, (batch.compactions, events)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8)
    checked = 0
    for k, request in enumerate(requests):
        _check_turn(model, contexts[k], request.ids, request.logprobs, sampling)
        checked += check_stream_picks(model, contexts[k], request.ids, sampling, k)
    assert checked >= 0.9 * sum(len(r.ids) for r in requests)


def test_a_join_prefills_the_joiner_alone_not_every_row_at_its_width(tiny_model, tiny_tokenizer):
    """A request joining rows already decoding: its prompt runs in a forward of its own ((1, W)), the decode rows in
    their usual (B, 1) step, never a (B, W) block of every row at the joiner's width; and the joiner still decodes
    what it decodes alone."""
    chat = ChatCodec(tiny_tokenizer)
    model = tiny_model.eval()
    contexts = [chat.start("", TEXTS[k % len(TEXTS)]).token_ids for k in range(4)]
    requests = [Request(c, 1.0, 1.0, 8, torch.Generator().manual_seed(k)) for k, c in enumerate(contexts)]
    batch = ContinuousBatch(model, stop_id=chat.im_end_id, pad_id=chat.pad_id)
    for request in requests[:3]:
        batch.add(request)
    batch.step()  # the first three prefill together (nothing cached yet)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        batch.add(requests[3])
        rows = len(batch.rows)  # the cache's rows, a freed one reused by the joiner
        batch.step()
    finally:
        hook.remove()
    assert shapes == [(1, len(contexts[3])), (rows, 1)], shapes
    while len(batch):
        batch.step()
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8)
    _check_turn(model, contexts[3], requests[3].ids, requests[3].logprobs, sampling)

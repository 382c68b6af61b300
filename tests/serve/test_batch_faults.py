"""A batch is shared, a failure is not (issue #39, items 4 and 5): a request the model cannot read fails alone,
and a request whose client went away leaves its batch; in both cases its batch mates sample what they would
have sampled without it. Both with the decoder on a thread and in its own process (serve.engine)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from lopd_serve.batching import Batcher
from lopd_serve.engine_process import EngineProcess
from lopd_serve.models import load_checkpoint
from tests.serve.conftest import make_server


def _contexts(loaded):
    chat = loaded.chat
    return [chat.start("", text).token_ids for text in ("hello there", "what is the weather", "count to three")]


async def _decode(batcher, loaded, contexts, seeds, max_tokens=12):
    return await asyncio.gather(
        *[
            batcher.generate(loaded, c, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed)
            for c, seed in zip(contexts, seeds)
        ],
        return_exceptions=True,
    )


def _run(coro_fn, engine: str = "thread"):
    kind = Batcher if engine == "thread" else EngineProcess
    batcher = kind(window_s=0.5, max_batch=8, seed=0)
    batcher.start()
    try:
        return asyncio.run(coro_fn(batcher))
    finally:
        batcher.stop()


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_request_the_model_cannot_read_fails_alone(tiny_checkpoints, engine):
    loaded = load_checkpoint(tiny_checkpoints[0], device="cpu")
    good = _contexts(loaded)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    bad = [*good[1], vocab + 3]  # an id past the embeddings: the forward raises for the whole batch

    async def alone_then_mixed(b):
        alone = [(await _decode(b, loaded, [c], [s]))[0] for c, s in zip(good, (7, 8, 9))]
        return alone, await _decode(b, loaded, [good[0], bad, good[1], good[2]], [7, 100, 8, 9])

    alone, mixed = _run(alone_then_mixed, engine)
    assert isinstance(mixed[1], IndexError | RuntimeError)
    for expected, got in zip(alone, [mixed[0], *mixed[2:]]):
        assert not isinstance(got, BaseException), got
        assert got.token_ids[:8] == expected.token_ids[:8]  # its own seeded stream, whatever failed beside it


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_row_whose_client_left_leaves_the_batch(tiny_checkpoints, engine):
    loaded = load_checkpoint(tiny_checkpoints[0], device="cpu")
    contexts = _contexts(loaded)[:2]
    seen: list[int] = []

    async def cancel_first(batcher):
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(
            batcher.generate(
                loaded,
                contexts[0],
                temperature=1.0,
                top_p=1.0,
                max_tokens=400,
                seed=7,
                on_token=lambda *a: loop.call_soon_threadsafe(seen.append, 1),
            )
        )
        second = asyncio.ensure_future(
            batcher.generate(loaded, contexts[1], temperature=1.0, top_p=1.0, max_tokens=40, seed=8)
        )
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        first.cancel()
        return await second

    alone = _run(lambda b: _decode(b, loaded, [contexts[1]], [8], max_tokens=40))[0]
    went_on = _run(cancel_first, engine)
    assert went_on.token_ids[:20] == alone.token_ids[:20]  # its stream replayed to where it was
    assert len(seen) < 40  # the cancelled row stopped decoding long before its max_tokens


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_an_abandoned_stream_stops_decoding(tiny_checkpoints, tmp_path, engine):
    """A client that closes a long stream: the server stops spending the decoder on it, and records nothing."""
    with make_server(tiny_checkpoints[0], tmp_path / "traces", engine=engine) as live:
        _abandon_a_stream(live)


def _abandon_a_stream(live) -> None:
    batcher = live.app.state.batcher
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 500, "seed": 3, "stream": True}
    full = httpx.post(live.url + "/chat/completions", json={**body, "stream": False, "max_tokens": 120}, timeout=120)
    assert full.json()["usage"]["completion_tokens"] == 120  # this seed does not end its turn early
    before = batcher.tokens
    with httpx.stream("POST", live.url + "/chat/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 6:
                break
    settled, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the decoder stops handing out tokens
        time.sleep(1.0)
        if settled == batcher.tokens:
            break
        settled = batcher.tokens
    assert settled == batcher.tokens
    assert settled - before < 300  # it left its batch well before its 500 tokens
    records = [json.loads(line) for f in live.app.state.store.dir.glob("traces-*.jsonl") for line in f.open()]
    assert len(records) == 1  # only the whole answer

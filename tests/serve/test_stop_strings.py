"""Stop strings (OpenAI's `stop`, issue #47 item 4), end to end with the openai client: the turn ends the step its
stop string's last character is sampled; the message is the text before it (finish_reason "stop"); a stream never
sends a character of it; the trace records every sampled id, the stop string's included, then the end token the
server closed the turn with, and scoring the recorded ids gives back the recorded log-probs; the client's echo
extends the same trajectory. Each request is seeded, so a run without the stop string shows what the model
samples, and the stopped run must be its prefix."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lopd_core.rollout.scoring import score_sequence
from lopd_core.traces.store import read_records
from tests.serve.conftest import make_server

USER = [{"role": "user", "content": "tell me about the keys"}]


def _free_turn(client) -> tuple[str, list[int], int]:
    """A seeded turn long enough to cut (text, sampled ids, seed), sampled without stop strings."""
    for seed in range(20):
        r = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=40, seed=seed, extra_body={"return_token_ids": True}
        )
        text = r.choices[0].message.content
        if len(text) >= 12:
            return text, r.choices[0].model_extra["token_ids"], seed
    raise AssertionError("no seed gave a turn of 12 characters")


def _stop_in(text: str) -> tuple[str, str]:
    """Two characters from the middle of `text` as a stop string, and the message expected with it."""
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    return stop, text[: text.index(stop)]


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_stop_string_ends_the_turn_and_is_recorded_token_exact(tiny_checkpoints, tmp_path, engine):
    with make_server(tiny_checkpoints[0], tmp_path / "traces", engine=engine) as live:
        _stop_and_replay(live)


def _stop_and_replay(live) -> None:
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)
    text, free_ids, seed = _free_turn(client)
    stop, expected = _stop_in(text)
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=40,
        seed=seed,
        stop=[stop, "zz-never"],
        extra_headers={"X-Session-Id": "stopped"},
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    sampled = choice.model_extra["token_ids"]
    assert (choice.message.content, choice.finish_reason) == (expected, "stop")
    assert sampled == free_ids[: len(sampled)] and len(sampled) < len(free_ids)  # the free turn's prefix
    loaded = live.app.state.holder.current
    decode = loaded.tokenizer.decode
    assert stop in decode(sampled) and stop not in decode(sampled[:-1])  # ended by the token that completed it

    [record] = [x for x in read_records(live.app.state.store.dir) if x.get("session") == "stopped"]
    ids, mask, logprobs = record["token_ids"], record["action_mask"], record["sample_logprobs"]
    assert [t for t, m in zip(ids, mask) if m] == sampled  # every sampled id, the stop string's included
    assert (ids[-1], mask[-1]) == (loaded.chat.im_end_id, 0)  # closed by the server, as a turn cut by max_tokens
    assert record["finish_reason"] == "stop" and record["messages"][-1]["content"] == expected
    assert record["sampling"]["stop"] == [stop, "zz-never"]
    scores = score_sequence(loaded.model, ids, top_k=0)  # replay: the model's log-probs of the recorded ids
    replayed = [scores.token_logprobs[n - 1] for n, m in enumerate(mask) if m]
    recorded = [lp for lp, m in zip(logprobs, mask) if m]
    assert max(abs(a - b) for a, b in zip(replayed, recorded)) < 1e-4  # temperature 1: the sampler's are the model's

    echo = [*USER, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    follow = client.chat.completions.create(
        model="tiny", messages=echo, max_tokens=3, extra_headers={"X-Session-Id": "stopped"}
    )
    assert follow.model_extra["lopd"]["trajectory_id"] == r.model_extra["lopd"]["trajectory_id"]


def test_a_stream_never_sends_the_stop_string(live):
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)
    text, _, seed = _free_turn(client)
    stop, expected = _stop_in(text)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, seed=seed, stop=stop, stream=True)
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_completions_stop_at_a_stop_string(live):
    loaded = live.app.state.holder.current
    prompt = loaded.chat.start("", USER[0]["content"]).token_ids
    for seed in range(20):
        body = {"prompt": prompt, "max_tokens": 40, "seed": seed, "return_token_ids": True}
        free = httpx.post(live.url + "/completions", json=body, timeout=60).json()["choices"][0]
        if len(free["text"]) >= 12:
            break
    stop, expected = _stop_in(free["text"])
    cut = httpx.post(live.url + "/completions", json={**body, "stop": stop}, timeout=60).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (expected, "stop")
    assert cut["token_ids"] == free["token_ids"][: len(cut["token_ids"])]


def test_stop_strings_beyond_the_limits_are_refused(live):
    for stop in (["a", "b", "c", "d", "e"], "", ["x" * 257]):
        response = httpx.post(live.url + "/chat/completions", json={"messages": USER, "stop": stop}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop", json.dumps(stop)

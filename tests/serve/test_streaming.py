"""Streaming is a true stream: tokens are sent as they are sampled, so the first content chunk arrives long before
the turn ends; the streamed text and log-probs are the turn's; a turn that may be a tool call is held and sent
whole."""

from __future__ import annotations

import json
import time

import httpx

from lopd_serve import chat as chat_module

LONG = 256


def _events(live, body: dict, session: str):
    """(arrival time, event) of each server-sent event of a streamed chat request, and the start time."""
    started = time.perf_counter()
    out = []
    with httpx.stream(
        "POST", live.url + "/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append((time.perf_counter(), None if data == "[DONE]" else json.loads(data)))
    return started, out


def test_the_first_token_arrives_before_the_turn_ends(live):
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "find key a"}],
        "max_tokens": LONG,
        "temperature": 1.0,
        "seed": 5,
        "stream": True,
        "logprobs": True,
    }
    started, events = _events(live, body, "stream-1")
    assert events[-1][1] is None  # [DONE]
    content = [(t, e) for t, e in events[:-1] if e["choices"][0]["delta"].get("content")]
    finished = next(t for t, e in events[:-1] if e["choices"][0]["finish_reason"])
    assert len(content) > LONG // 2  # the turn ran long: one chunk per token (or close)
    first = content[0][0]
    # the first chunk came while most of the decoding was still ahead (a stream of a finished turn would send
    # every chunk within a moment of the end)
    assert finished - first > 0.5 * (finished - started)
    whole = httpx.post(
        live.url + "/chat/completions",
        json={**body, "stream": False},
        headers={"X-Session-Id": "stream-2"},
        timeout=120,
    ).json()
    streamed = "".join(e["choices"][0]["delta"]["content"] for _, e in content)
    assert streamed == whole["choices"][0]["message"]["content"]
    streamed_lps = [
        lp["logprob"]
        for _, e in events[:-1]
        if e["choices"][0]["logprobs"]
        for lp in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed_lps == [lp["logprob"] for lp in whole["choices"][0]["logprobs"]["content"]]


def test_a_streamed_tool_call_arrives_whole(live, monkeypatch):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}

    def as_tool_call(chat, sampled, **kw):
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", "key"

    monkeypatch.setattr(chat_module, "reply", as_tool_call)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "find key a"}],
        "tools": tools,
        "max_tokens": 16,
        "seed": 1,
        "stream": True,
    }
    _, events = _events(live, body, "stream-tools")
    deltas = [e["choices"][0]["delta"] for _, e in events[:-1]]
    assert not any(d.get("content") for d in deltas)  # held: the turn was a call, never sent as text
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert len(calls) == 1 and calls[0][0]["function"] == call["function"]
    assert events[-2][1]["choices"][0]["finish_reason"] == "tool_calls"

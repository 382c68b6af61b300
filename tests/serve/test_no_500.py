"""No request reaches a 500, and every number the server stores or answers is finite (issue #39, item 4).

A sampling value that is valid JSON and inside its range can still make the decoder divide by almost nothing
(a temperature of 1e-40 turns float32 logits into infinities), and a top-k wider than what top-p keeps holds
-inf log-probs: both ended in a JSON writer refusing a non-finite number after the turn was sampled. Text that is
not UTF-8 (a lone surrogate, which JSON's `\\ud800` escape can carry) reached the tokenizer and crashed it."""

from __future__ import annotations

import json
import math

import httpx

from lopd_core.traces.store import read_records


def _post_raw(live, raw: str, path="/chat/completions"):
    return httpx.post(live.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def _strict_json(text: str):
    """JSON as a strict client reads it: NaN and infinities are not numbers."""

    def refuse(constant):
        raise AssertionError(f"non-finite number {constant} in a response")

    return json.loads(text, parse_constant=refuse)


def _numbers(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _ask(content, **kw) -> str:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 3, **kw})


def test_sampling_values_store_and_answer_only_finite_numbers(live):
    cases = [
        _ask("hi", temperature=1e-40),  # float32 logits / 1e-40 are infinities: clamped to greedy, as vLLM does
        _ask("hi", temperature=5e-324),
        _ask("hi", temperature=1e-6),
        _ask("hi", top_p=1e-9, logprobs=True, top_logprobs=5),  # top-p keeps one token: the others are -inf
        _ask("hi", top_p=1e-9, logprobs=True, top_logprobs=5, stream=True),
        _ask("hi", seed=2**200),
        _ask("hi", seed=-(2**70)),
    ]
    for raw in cases:
        response = _post_raw(live, raw)
        assert response.status_code == 200, (raw, response.text)
        if '"stream": true' in raw:
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for event in events[:-1]:
                _strict_json(event)
        else:
            _strict_json(response.text)
    greedy = _strict_json(_post_raw(live, _ask("hi", temperature=1e-40, seed=1)).text)
    again = _strict_json(_post_raw(live, _ask("hi", temperature=0, seed=2)).text)
    assert greedy["choices"][0]["message"] == again["choices"][0]["message"]  # a clamped temperature is greedy
    completion = _post_raw(
        live, json.dumps({"prompt": [5, 6], "max_tokens": 2, "top_p": 1e-9, "logprobs": 5}), "/completions"
    )
    assert completion.status_code == 200, completion.text
    _strict_json(completion.text)
    records = list(read_records(live.app.state.store.dir))
    assert len(records) == len(cases) + 2
    assert all(math.isfinite(v) for r in records for v in _numbers(r))
    assert {r["sampling"]["temperature"] for r in records[:2]} == {0.0}  # recorded as what was used


def test_text_that_is_not_utf8_is_a_400(live):
    surrogate = "a\ud800b"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"k": surrogate})}}
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {surrogate: {}}}},
    }
    bodies = [
        _ask(surrogate),
        _ask(surrogate, stream=True),
        _ask([{"type": "text", "text": surrogate}]),
        json.dumps({"messages": [{"role": "system", "content": "\udfff"}, {"role": "user", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [tool]}),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "content": "1"},
                ],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            }
        ),
    ]
    for raw in bodies:
        response = _post_raw(live, raw)
        assert response.status_code == 400, (raw, response.text)
        assert "UTF-8" in response.json()["error"]["message"]
    assert _post_raw(live, json.dumps({"prompt": surrogate, "max_tokens": 1}), "/completions").status_code == 400
    assert not list(read_records(live.app.state.store.dir))
    # other unusual text is text: NUL, a byte-order mark, noncharacters, astral planes, combining marks
    for text in ("a\x00b", "\ufeffhi", "\uffff\U0010ffff", "e\u0301 \U0001f600 \u200d"):
        assert _post_raw(live, _ask(text, user="fine")).status_code == 200
    ok = _post_raw(
        live, json.dumps({"session": "fine", "reward": 0.0, "success": False, "checks": {surrogate: 1}}), "/feedback"
    )
    assert ok.status_code == 400, ok.text

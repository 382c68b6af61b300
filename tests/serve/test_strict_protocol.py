"""Request types as strict as `/v1/feedback`'s (issue #39 item 6): a field whose meaning the server would
change by ignoring it is refused with a 400 naming it, a value of the wrong JSON type is refused rather than
coerced, the fields OpenAI makes nullable accept null, and what is accepted is implemented
(`stream_options.include_usage`). Any other unknown top-level field is answered, ignored, and named in a
`Warning` header and a log line, as vLLM does (issue #47 item 4)."""

from __future__ import annotations

import json

import httpx
import pytest

from lopd_core.traces.store import read_records

USER = [{"role": "user", "content": "hi"}]


def _post(live, body, path="/chat/completions"):
    return httpx.post(live.url + path, json=body, timeout=60)


def _refused(response, field: str, code: str = "unsupported_field") -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and field in error["message"], error
    return error["message"]


def test_fields_the_server_would_silently_change_are_refused_by_name(live):
    cases = [
        ({"messages": USER, "max_tokens": 2, "functions": [{"name": "f"}]}, "functions", "unsupported_field"),
        ({"messages": USER, "max_tokens": 2, "top_k": 5}, "top_k", "unsupported_field"),
        ({"messages": [{"role": "user", "content": "hi", "nmae": "x"}], "max_tokens": 2}, "nmae", "unsupported_field"),
        (
            {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2},
            "name",
            "unsupported_field",
        ),
        ({"messages": USER, "max_tokens": 2, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported"),
        ({"messages": USER, "max_tokens": 2, "logit_bias": {"5": 10}}, "logit_bias", "unsupported"),
        ({"messages": USER, "max_tokens": 2, "store": False}, "store", "unsupported"),
        ({"messages": USER, "max_tokens": 2, "top_logprobs": 2}, "top_logprobs", "unsupported"),
        (
            {"messages": USER, "max_tokens": 2, "stream_options": {"include_usage": True}},
            "stream_options",
            "unsupported",
        ),
        ({"messages": USER, "max_tokens": 2, "n": 2}, "n", "unsupported"),
    ]
    for body, field, code in cases:
        _refused(_post(live, body), field, code)
    both = _post(live, {"messages": USER, "max_tokens": 2, "functions": [], "function_call": "auto"})
    assert "functions" in _refused(both, "function_call")  # every such field is named, not only the first
    assert both.json()["error"]["param"] == "function_call"
    _refused(_post(live, {"prompt": [1, 2], "max_tokens": 1, "best_of": 2}, "/completions"), "best_of")
    _refused(
        _post(live, {"prompt": [1, 2], "max_tokens": 1, "include_stop_str_in_output": False}, "/completions"),
        "include_stop_str_in_output",
        "unsupported",
    )
    assert not list(read_records(live.app.state.store.dir))  # nothing refused was recorded


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("max_tokens", "3"),
        ("max_tokens", 3.0),
        ("seed", True),
        ("stream", "true"),
        ("stream", 1),
        ("logprobs", "yes"),
        ("user", 7),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(live, field, value):
    body = {"messages": USER, "max_tokens": 2, field: value}
    response = _post(live, body)
    assert response.status_code == 400, (field, value, response.text)
    assert response.json()["error"]["param"] == field


def test_nulls_are_the_defaults_and_no_op_values_are_served(live):
    body = {
        "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
        "max_tokens": 2,
        "temperature": None,
        "n": 1,
        "stop": None,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "store": True,
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "seed": None,
    }
    assert _post(live, body).status_code == 200
    # a reply sent back as the openai package dumps it (null response-only fields included) is accepted
    reply = {"role": "assistant", "content": "x", "refusal": None, "annotations": None, "audio": None}
    history = [*USER, {**reply, "function_call": None, "tool_calls": None}, {"role": "user", "content": "more"}]
    assert _post(live, {"messages": history, "max_tokens": 2}).status_code == 200


def test_stream_options_include_usage_sends_the_usage_last(live):
    body = {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    lines = _post(live, body).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all("usage" not in e for e in events[:-1])


def test_tool_messages_answer_the_calls_they_name(live):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def call(cid):
        return {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}

    turn = {"role": "assistant", "content": None, "tool_calls": [call("a"), call("b")]}
    cases = {
        "answers no open call": [*USER, turn, {"role": "tool", "tool_call_id": "z", "content": "1"}],
        "have no tool message": [*USER, turn, {"role": "tool", "tool_call_id": "a", "content": "1"}],
        "share an id": [*USER, {**turn, "tool_calls": [call("a"), call("a")]}],
        "needs content": [*USER, turn, {"role": "tool", "tool_call_id": "a"}],
        "only a tool message answers": [{"role": "user", "content": "x", "tool_call_id": "a"}],
        "only an assistant message holds calls": [{"role": "user", "content": "x", "tool_calls": [call("a")]}],
    }
    for why, messages in cases.items():
        response = _post(live, {"messages": messages, "tools": tools, "max_tokens": 2})
        assert response.status_code == 400 and why in response.json()["error"]["message"], (why, response.text)
    missing_id = [*USER, turn, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert _post(live, {"messages": missing_id, "tools": tools, "max_tokens": 2}).status_code == 400
    either_order = [
        *USER,
        turn,
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
    ]
    assert _post(live, {"messages": either_order, "tools": tools, "max_tokens": 2}).status_code == 200


def test_other_unknown_fields_are_ignored_with_a_warning(live, caplog):
    body = {"messages": USER, "max_tokens": 2, "temprature": 0.5, "metadata": {"k": "v"}, "service_tier": "auto"}
    with caplog.at_level("WARNING", logger="lopd.serve"):
        answer = _post(live, body)
        streamed = _post(live, {**body, "stream": True})
        completion = _post(live, {"prompt": [1, 2], "max_tokens": 1, "prompt_cache_key": "x"}, "/completions")
    expected = '299 lopd "unknown fields ignored: metadata, service_tier, temprature"'
    assert answer.status_code == 200 and answer.headers["warning"] == expected
    assert streamed.status_code == 200 and streamed.headers["warning"] == expected
    assert completion.status_code == 200 and "prompt_cache_key" in completion.headers["warning"]
    assert "ignored unknown request fields: metadata, service_tier, temprature" in caplog.text
    assert "warning" not in _post(live, {"messages": USER, "max_tokens": 2}).headers
    # a name that is no header text (a quote, a newline, non-ASCII) is escaped, and a flood of them is counted
    odd = _post(live, {"messages": USER, "max_tokens": 2, 'x"\nq\u00e9': 1})
    assert (
        odd.status_code == 200 and odd.headers["warning"] == """299 lopd "unknown fields ignored: x\\'\\nq\\u00e9\""""
    )
    flood = _post(live, {"messages": USER, "max_tokens": 2, **{f"f{k:02d}": 1 for k in range(20)}})
    assert flood.status_code == 200 and flood.headers["warning"].endswith('f15 and 4 more"')
    # the turn is served and recorded as without them
    records = [r for r in read_records(live.app.state.store.dir) if r.get("kind") == "turn"]
    assert len(records) == 5 and records[0]["sampling"]["temperature"] == 1.0

"""Every request the server accepts is one the learning path can read (issue #39 item 3): hypothesis generates
OpenAI-valid chat requests — every content form (a string, a list of text parts), system or developer first,
user, assistant and tool turns, one or several tool calls per assistant turn with their results in any order,
arguments of any JSON, unicode the spec allows (any character but a lone surrogate), sampling settings, streamed
or not — serves them on the real app, sends each reply back with the next message (it must extend the same
trajectory), labels the conversations through /v1/feedback, and then runs the learning path on the store:
the trace table and its parquet snapshot, the rollout view, the bank from traces and one distillation step.

The default example count keeps the fast tier to seconds; `test_round_trip_many` is the slow, larger run."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from lopd_core.traces import read_traces, snapshot, trace_table, traces_as_trajectories
from lopd_core.traces.source import load_traces
from tests.serve.conftest import make_server

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=10)  # any character JSON and UTF-8 carry
KEYS = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=6,
)
TOOL_NAMES = st.from_regex(r"\A[A-Za-z0-9_-]{1,12}\Z")


def content():
    """A message's content in either of OpenAI's forms: a string, or a list of text parts."""
    parts = st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3)
    return st.one_of(TEXT, parts)


@st.composite
def tools(draw) -> list[dict]:
    names = draw(st.lists(TOOL_NAMES, max_size=3, unique=True))
    declared = []
    for name in names:
        function = {"name": name}
        if draw(st.booleans()):
            function["description"] = draw(TEXT)
        if draw(st.booleans()):
            properties = draw(st.dictionaries(KEYS, st.just({"type": "string"}), max_size=3))
            function["parameters"] = {"type": "object", "properties": properties, "x-extra": draw(JSON_VALUES)}
        declared.append({"type": "function", "function": function})
    return declared


@st.composite
def assistant_turn(draw, names: list[str], number: int) -> list[dict]:
    """An assistant message the client wrote, and what follows it: the results of its calls (one or several,
    in any order), an observation after a plain reply (the rollout engine's shape), or a user message."""
    if names and draw(st.booleans()):
        calls = [
            {
                "id": f"call-{number}-{k}",
                "type": "function",
                "function": {
                    "name": draw(st.sampled_from(names)),
                    "arguments": json.dumps(
                        draw(st.dictionaries(KEYS, JSON_VALUES, max_size=3)), ensure_ascii=draw(st.booleans())
                    ),
                },
            }
            for k in range(draw(st.integers(1, 3)))
        ]
        message = {"role": "assistant", "tool_calls": calls, "content": draw(st.none() | content())}
        answers = draw(st.permutations(calls))
        return [message] + [{"role": "tool", "tool_call_id": c["id"], "content": draw(content())} for c in answers]
    message = {"role": "assistant", "content": draw(content())}
    if draw(st.booleans()):
        return [message, {"role": "tool", "tool_call_id": "observation", "content": draw(content())}]
    return [message, {"role": "user", "content": draw(content())}]


@st.composite
def chat_requests(draw) -> dict:
    declared = draw(tools())
    names = [t["function"]["name"] for t in declared]
    messages = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(content())})
    messages.append({"role": "user", "content": draw(content())})
    for number in range(draw(st.integers(0, 2))):
        messages += draw(assistant_turn(names, number))
    body = {
        "messages": messages,
        "max_tokens": draw(st.integers(1, 4)),
        "temperature": draw(st.sampled_from([0.0, 1e-7, 0.7, 1.0, 2.0])),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.01])),
        "seed": draw(st.none() | st.integers(-(2**63), 2**64)),
        "stream": draw(st.booleans()),
    }
    if declared:
        body["tools"] = declared
        body["tool_choice"] = draw(st.sampled_from([None, "auto", "none"]))
        body["parallel_tool_calls"] = draw(st.sampled_from([None, True, False]))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 3))
    return body


def _whole(response: httpx.Response, stream: bool) -> dict:
    """The reply's message (a stream's events assembled) and the response's `lopd` extension."""
    if not stream:
        out = response.json()
        return {"message": out["choices"][0]["message"], "lopd": out["lopd"]}
    message, lopd = {"role": "assistant", "content": ""}, {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        lopd = event.get("lopd", lopd)
        for choice in event["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            if delta.get("tool_calls"):
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return {"message": message, "lopd": lopd}


def _follow_up(message: dict) -> list[dict]:
    """The client's next messages after a reply: a result for every call it made, else a user message."""
    if message.get("tool_calls"):
        return [{"role": "tool", "tool_call_id": c["id"], "content": "ok ✓"} for c in message["tool_calls"]]
    return [{"role": "user", "content": "go on"}]


def _served(response: httpx.Response, body: dict) -> bool:
    """Answered (200), or refused for the one documented limit a generated conversation can reach: the context
    (rare characters are several byte tokens each). Anything else fails the test."""
    if response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded":
        return False
    assert response.status_code == 200, (body, response.text)
    return True


def _serve_and_label(live, body: dict, session: str, reward: float) -> None:
    http = httpx.Client(base_url=live.url, timeout=60)
    first = http.post("/chat/completions", json={**body, "user": session})
    assume(_served(first, body))
    reply = _whole(first, body["stream"])
    tid = reply["lopd"]["trajectory_id"]
    history = body["messages"] + [reply["message"], *_follow_up(reply["message"])]
    second = http.post("/chat/completions", json={**body, "messages": history, "user": session})
    if not _served(second, history):  # the first turn is labeled alone
        history = None
    if history is not None:
        assert _whole(second, body["stream"])["lopd"]["trajectory_id"] == tid, "the reply sent back did not extend"
    label = {"session": session, "reward": reward, "success": reward == 1.0}
    labeled = http.post("/feedback", json=label)
    assert labeled.status_code == 200 and labeled.json()["trajectory_id"] == tid, labeled.text


def _learn(store, tmp_path, tiny_model, tiny_tokenizer) -> None:
    """The learning path on the store: tables, snapshot, the bank from traces, one distillation step."""
    from dataclasses import replace

    from lopd_core.config import Params
    from lopd_core.drivers.bank import run_bank
    from tests.traces.test_traffic_learning import _distiller, _params

    traces = read_traces(store)
    assert traces["labeled"].all()
    assert len(traces_as_trajectories(traces, labeled_only=False)) == len(traces)
    parquet = snapshot(store, tmp_path / "traces.parquet")
    assert len(trace_table(parquet)) == len(load_traces(store))
    p = Params()
    p.bank = replace(p.bank, dir=str(tmp_path / "bank"), index_dir=str(tmp_path / "index"))
    p.lopd = replace(p.lopd, bank_source="traces", traces=str(store))
    summary = run_bank(p, restart=True, log=lambda *_: None)
    assert summary["traces"] == len(traces)
    distiller = _distiller(_params(tmp_path, store, trajectories="traces"), tiny_model, tiny_tokenizer)
    assert distiller.step().row.rollouts > 0


def _round_trip(tiny_checkpoints, tiny_model, tiny_tokenizer, tmp_path, examples: int) -> None:
    store = tmp_path / "traces"
    sessions = itertools.count()
    with make_server(tiny_checkpoints[0], store) as live:

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # the same requests every run: a failure is reproducible from the test alone
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            database=None,
            # no shrinking: each example is a server round trip, and shrinking one took minutes
            phases=[Phase.explicit, Phase.generate],
        )
        @given(body=chat_requests(), reward=st.sampled_from([0.0, 0.25, 1.0]))
        def serve_one(body, reward):
            _serve_and_label(live, body, f"rt-{next(sessions)}", reward)

        serve_one()
    _learn(store, tmp_path, tiny_model, tiny_tokenizer)


def test_round_trip(tiny_checkpoints, tiny_model, tiny_tokenizer, tmp_path):
    _round_trip(tiny_checkpoints, tiny_model, tiny_tokenizer, tmp_path, examples=25)


@pytest.mark.slow
def test_round_trip_many(tiny_checkpoints, tiny_model, tiny_tokenizer, tmp_path):
    _round_trip(tiny_checkpoints, tiny_model, tiny_tokenizer, tmp_path, examples=150)


def test_a_blank_first_user_message_is_never_a_success(live):
    """Found by the round trip: an empty user message is valid OpenAI, and its conversation labeled a success
    made the bank refuse its whole refresh (a bank row needs a task text to be found by). It is served and
    trained on, never a success in the rollout view, so never offered to the bank."""
    for session, text in (("blank", ""), ("spaces", "  "), ("task", "[cobalt] pay Noah")):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "user": session}
        assert httpx.post(live.url + "/chat/completions", json=body, timeout=60).status_code == 200
        label = {"session": session, "reward": 1.0, "success": True}
        assert httpx.post(live.url + "/feedback", json=label, timeout=30).status_code == 200
    rows = traces_as_trajectories(read_traces(live.app.state.store.dir))
    assert len(rows) == 3 and (rows["reward"] == 1.0).all()
    assert [json.loads(t)["instruction"] for t in rows[rows["success"]]["task"]] == ["[cobalt] pay Noah"]

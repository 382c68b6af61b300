"""The endpoint through the official openai client and raw HTTP: chat, streaming, sessions, feedback, limits.

One server per test on loopback with a tiny random model; what the store holds is read back through the trace
table's schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lopd_core.traces import read_traces, traces_as_trajectories

SYSTEM = "tools: lookup(key)"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]


def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)


def ask(c, messages, session="s1", **kw):
    return c.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=8,
        seed=1,
        extra_headers={"X-Session-Id": session},
        **kw,
    )


def first_turn():
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "find key a"}]


def test_chat_session_extension_and_feedback(live):
    c = client(live)
    r1 = ask(c, first_turn())
    assert r1.choices[0].finish_reason in ("stop", "length")
    # the client replays its history with the reply it was given: same trajectory
    history = first_turn() + [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "t", "content": "value 7"},
    ]
    r2 = ask(c, history)
    assert r2.model_extra["lopd"]["trajectory_id"] == r1.model_extra["lopd"]["trajectory_id"]
    # an edited assistant message branches a new trajectory, recorded as such
    edited = first_turn() + [
        {"role": "assistant", "content": "something else"},
        {"role": "tool", "tool_call_id": "t", "content": "value 7"},
    ]
    r3 = ask(c, edited)
    assert r3.model_extra["lopd"]["trajectory_id"] != r1.model_extra["lopd"]["trajectory_id"]
    ok = httpx.post(live.url + "/feedback", json={"session": "s1", "reward": 1.0, "success": True})
    assert ok.status_code == 200 and ok.json()["trajectory_id"] == r3.model_extra["lopd"]["trajectory_id"]

    traces = read_traces(live.app.state.store.dir).set_index("trajectory_id")
    first = traces.loc[r1.model_extra["lopd"]["trajectory_id"]]
    branch = traces.loc[r3.model_extra["lopd"]["trajectory_id"]]
    assert first["num_turns"] == 2 and first["origin"] == "new" and not first["labeled"]
    assert branch["origin"] == "assistant_differs" and branch["parent"] == first.name
    assert branch["labeled"] and branch["success"] and branch["reward"] == 1.0
    # the first trajectory's ids: the prompt forced, both sampled turns marked as actions with their log-probs
    sampled = r1.usage.completion_tokens + r2.usage.completion_tokens
    assert sum(first["action_mask"]) == sampled
    assert all(lp < 0 for lp, m in zip(first["sample_logprobs"], first["action_mask"]) if m)
    assert first["token_ids"][: r1.usage.prompt_tokens] == first["token_ids"][: first["prompt_length"]]
    assert len(first["token_ids"]) == r2.usage.total_tokens + (r2.choices[0].finish_reason == "length")
    # the edited reply is forced in the branch: only its own sampled turn counts as actions
    assert sum(branch["action_mask"]) == r3.usage.completion_tokens
    # as rollout-table rows: the labeled trace only, never an unlabeled success; and the branch holds a reply the
    # client wrote ("something else"), so its label's reward stays but it is no success of the model's
    rows = traces_as_trajectories(read_traces(live.app.state.store.dir))
    assert list(rows["task_id"]) == [branch.name] and rows["reward"][0] == 1.0 and not rows["success"].any()
    everything = traces_as_trajectories(read_traces(live.app.state.store.dir), labeled_only=False)
    assert len(everything) == 2 and everything["success"].sum() == 0


def test_seeded_requests_repeat_and_stream_matches(live):
    c = client(live)
    a = ask(c, first_turn(), session="x1", temperature=1.0)
    b = ask(c, first_turn(), session="x2", temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same tokens
    chunks = list(ask(c, first_turn(), session="x3", stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == a.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == a.choices[0].finish_reason
    models = c.models.list().data
    assert models and models[0].id == "a"
    assert httpx.get(live.root + "/health").json()["status"] == "ok"


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    return error


def test_bad_requests_are_4xx_json(live):
    url = live.url + "/chat/completions"

    def post(body, **kw):
        return httpx.post(url, json=body, **kw)

    base = {"model": "tiny", "messages": first_turn(), "max_tokens": 4}
    assert (
        _error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)["code"]
        == "invalid_json"
    )
    _error(post({**base, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}],
    }
    undeclared = {**base, "tools": TOOLS, "messages": first_turn() + [call, {"role": "tool", "content": "x"}]}
    assert _error(post(undeclared), 400)["code"] == "undeclared_tool"
    assert _error(post({**base, "max_tokens": 10**6}), 400)["code"] == "max_tokens_too_large"
    assert _error(post({**base, "messages": first_turn() * 40}), 400)["code"] in (
        "too_many_messages",
        "invalid_messages",
    )
    assert _error(post({**base, "messages": [{"role": "user", "content": "x" * 3_000_000}]}), 413)
    assert _error(post({**base, "messages": first_turn()[:1]}), 400)["code"] == "invalid_messages"
    long_text = " ".join(["key"] * 3000)
    assert (
        _error(post({**base, "messages": [{"role": "user", "content": long_text}]}), 400)["code"]
        == "context_length_exceeded"
    )
    assert _error(post({**base, "n": 2}), 400)["code"] == "unsupported"
    fb = live.url + "/feedback"
    ask(client(live), first_turn(), session="fb")
    assert _error(httpx.post(fb, json={"session": "fb", "reward": 1.5, "success": False}), 422)
    assert _error(httpx.post(fb, json={"session": "fb", "reward": 0.5, "success": True}), 422)
    assert _error(httpx.post(fb, json={"session": "nobody", "reward": 0.5, "success": False}), 404)
    assert (
        _error(
            httpx.post(fb, json={"session": "fb", "trajectory_id": "traj-made-up", "reward": 0.5, "success": False}),
            404,
        )["code"]
        == "unknown_trajectory"
    )
    anonymous = post(base).json()["lopd"]  # no session named: label it by the ids the response gave
    assert (
        httpx.post(
            fb,
            json={
                "session": anonymous["session"],
                "trajectory_id": anonymous["trajectory_id"],
                "reward": 0.0,
                "success": False,
            },
        ).status_code
        == 200
    )
    assert httpx.get(live.root + "/health").status_code == 200  # still serving


def test_api_key_and_exposure(tiny_checkpoints, tmp_path, monkeypatch):
    from lopd_serve.config import ServeConfig, ServeConfigError
    from tests.serve.conftest import make_server

    with pytest.raises(ServeConfigError, match="API key"):
        ServeConfig.from_dict({"host": "0.0.0.0", "api_key_env": "LOPD_TEST_KEY_UNSET"}).check_exposure()
    monkeypatch.setenv("LOPD_TEST_KEY", "sesame")
    ServeConfig.from_dict({"host": "0.0.0.0", "api_key_env": "LOPD_TEST_KEY"}).check_exposure()
    with make_server(tiny_checkpoints[0], tmp_path / "t", api_key_env="LOPD_TEST_KEY") as live:
        body = {"model": "tiny", "messages": first_turn(), "max_tokens": 2}
        assert _error(httpx.post(live.url + "/chat/completions", json=body), 401)["type"] == "authentication_error"
        ok = httpx.post(live.url + "/chat/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert _error(httpx.post(live.root + "/admin/reload", json={}), 403)  # no reload key: reload is off


def test_session_cap_is_429(tiny_checkpoints, tmp_path):
    from tests.serve.conftest import make_server

    with make_server(tiny_checkpoints[0], tmp_path / "t", max_sessions=1) as live:
        body = {"model": "tiny", "messages": first_turn(), "max_tokens": 2}
        assert httpx.post(live.url + "/chat/completions", json={**body, "user": "one"}).status_code == 200
        # an idle session makes room (the least recently used); one answering a turn never does
        assert httpx.post(live.url + "/chat/completions", json={**body, "user": "two"}).status_code == 200
        live.app.state.sessions.sessions["two"].lock = _Busy()
        assert _error(httpx.post(live.url + "/chat/completions", json={**body, "user": "three"}), 429)


class _Busy:
    """A session lock held by a turn being answered."""

    def locked(self) -> bool:
        return True


def test_a_labeled_session_makes_room_for_a_new_one(tiny_checkpoints, tmp_path):
    """A client playing more labeled episodes than serve.max_sessions within the idle time is not refused: a
    session whose conversation got its feedback is the first to make room; one answering a turn is never evicted."""
    from tests.serve.conftest import make_server

    with make_server(tiny_checkpoints[0], tmp_path / "t", max_sessions=1) as live:
        body = {"model": "tiny", "messages": first_turn(), "max_tokens": 2}
        assert httpx.post(live.url + "/chat/completions", json={**body, "user": "one"}).status_code == 200
        label = {"session": "one", "reward": 1.0, "success": True}
        assert httpx.post(live.url + "/feedback", json=label).status_code == 200
        assert httpx.post(live.url + "/chat/completions", json={**body, "user": "two"}).status_code == 200
        live.app.state.sessions.sessions["two"].lock = _Busy()  # answering a turn: never evicted
        assert _error(httpx.post(live.url + "/chat/completions", json={**body, "user": "three"}), 429)
    assert sorted(read_traces(tmp_path / "t")["session"]) == ["one", "two"]


def test_full_store_refuses_with_503(tiny_checkpoints, tmp_path):
    from tests.serve.conftest import make_server

    with make_server(tiny_checkpoints[0], tmp_path / "t", store_max_bytes=1) as live:
        body = {"model": "tiny", "messages": first_turn(), "max_tokens": 2}
        assert httpx.post(live.url + "/chat/completions", json=body).status_code == 200  # the store was empty
        error = _error(httpx.post(live.url + "/chat/completions", json=body), 503)
        assert error["code"] == "trace_store_full" and "snapshot" in error["message"]
    assert len(read_traces(tmp_path / "t")) == 1  # the answered request is kept, nothing dropped silently
    assert json.loads(read_traces(tmp_path / "t")["messages"][0])[-1]["role"] == "assistant"

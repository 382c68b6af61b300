"""Sessions persist across a restart (issue #39 item 1): a server started on a store goes on with the
conversations it holds — same session, same trajectory, labels on the right turns — instead of starting each
continued conversation anew with its history forced."""

from __future__ import annotations

import httpx

from lopd_core.model.chat import IM_END
from lopd_core.traces import read_traces
from tests.serve.conftest import make_server


def ask(live, session: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 3, "seed": 1, "user": session, "return_token_ids": True}
    response = httpx.post(live.url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def label(live, session: str, **extra) -> httpx.Response:
    return httpx.post(live.url + "/feedback", json={"session": session, "reward": 1.0, "success": True, **extra})


def test_a_conversation_goes_on_in_its_trajectory_after_a_restart(tiny_checkpoints, tiny_tokenizer, tmp_path):
    store = tmp_path / "traces"
    talk = [{"role": "user", "content": "[cobalt] pay Noah"}]
    with make_server(tiny_checkpoints[0], store) as live:
        first = ask(live, "s", talk)
        talk += [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        second = ask(live, "s", talk)
        judged = ask(live, "j", [{"role": "user", "content": "hello"}])
        assert label(live, "j").json()["turns"] == 1
    tid = first["lopd"]["trajectory_id"]
    assert second["lopd"]["trajectory_id"] == tid

    with make_server(tiny_checkpoints[0], store) as again:  # a new process's app on the same store
        talk += [second["choices"][0]["message"], {"role": "user", "content": "thanks"}]
        third = ask(again, "s", talk)
        assert third["lopd"]["trajectory_id"] == tid  # the same trajectory, extended
        # extended, not rendered again: the context is what the first process recorded, then the new message
        assert third["prompt_token_ids"][: len(second["prompt_token_ids"])] == second["prompt_token_ids"]
        labeled = label(again, "s")
        assert labeled.status_code == 200 and labeled.json() == {"ok": True, "trajectory_id": tid, "turns": 3}
        # a label from before the restart still judges its turns: the next turn starts a new trajectory
        after = ask(again, "j", [{"role": "user", "content": "hello"}, judged["choices"][0]["message"]] + talk[-1:])
        assert after["lopd"]["trajectory_id"] != judged["lopd"]["trajectory_id"]
        # and a trajectory the first process recorded can still be labeled by id
        relabel = label(again, "j", trajectory_id=judged["lopd"]["trajectory_id"], reward=0.5, success=False)
        assert relabel.status_code == 200, relabel.text

    traces = read_traces(store).set_index("trajectory_id")
    assert len(traces) == 3
    trace = traces.loc[tid]
    assert trace["session"] == "s" and trace["num_turns"] == 3 and trace["labeled"] and trace["success"]
    sampled = [len(r["choices"][0]["token_ids"]) for r in (first, second, third)]
    assert sum(trace["action_mask"]) == sum(sampled)  # every sampled turn an action, nothing else
    # a turn cut at max_tokens is closed by the server with a forced end token
    closing = [] if third["choices"][0]["finish_reason"] == "stop" else [tiny_tokenizer.convert_tokens_to_ids(IM_END)]
    assert list(trace["token_ids"]) == third["prompt_token_ids"] + third["choices"][0]["token_ids"] + closing
    assert traces.loc[after["lopd"]["trajectory_id"]]["origin"] == "after_label"
    assert traces.loc[judged["lopd"]["trajectory_id"]]["reward"] == 0.5


def test_a_restart_with_another_model_starts_a_new_trajectory(tiny_checkpoints, tmp_path):
    store = tmp_path / "traces"
    talk = [{"role": "user", "content": "hi"}]
    with make_server(tiny_checkpoints[0], store) as live:
        first = ask(live, "s", talk)
    with make_server(tiny_checkpoints[1], store) as other:
        talk += [first["choices"][0]["message"], {"role": "user", "content": "more"}]
        second = ask(other, "s", talk)
    traces = read_traces(store).set_index("trajectory_id")
    branch = traces.loc[second["lopd"]["trajectory_id"]]
    assert branch["origin"] == "model_changed" and branch["parent"] == first["lopd"]["trajectory_id"]

"""Constrained decoding end to end with the openai client (issue #47 item 4): `tool_choice="required"`, a named
function and `response_format` (json_object, json_schema through the client's own `parse`) on the random tiny model,
which left alone almost never writes a call or JSON, in both engine modes. Each answer is what was asked (a call of
a declared tool, the named one; a JSON object of the schema), recorded token-exact: the trace keeps every sampled
id and the constraint (`sampling.constraint`), and a replay of the record reproduces the turn — the recorded ids
decoded again from the recorded context, seed and constraint, and the recorded log-probs as the masked
distribution's. The client's echo of a call extends the same trajectory. Requests are seeded; a turn cut by
max_tokens (a string the random model never closes) is tried with the next seed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel

from lopd_core.rollout.constrained import Constrained
from lopd_core.rollout.continuous import ContinuousBatch, Request
from lopd_core.rollout.decode import sampling_logprobs
from lopd_core.rollout.trajectory import Sampling
from lopd_core.rollout.turn_grammar import OutputConstraint
from lopd_core.traces.store import read_records
from tests.serve.conftest import make_server

USER = [{"role": "user", "content": "find the key"}]
PARAMETERS = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": PARAMETERS}} for n in ("lookup", "send")]
MAX_TOKENS = 300


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]


def _finished(create, finish: str, seeds=range(12)):
    """The first seeded answer that finished as `finish` (not cut by max_tokens), and its seed."""
    for seed in seeds:
        r = create(seed)
        assert r.choices[0].finish_reason in (finish, "length"), r.choices[0]
        if r.choices[0].finish_reason == finish:
            return r, seed
    raise AssertionError(f"no seed of {list(seeds)} finished with {finish!r} within {MAX_TOKENS} tokens")


def _record(live, session: str) -> dict:
    [record] = [r for r in read_records(live.app.state.store.dir) if r.get("session") == session]
    return record


def _replays(live, record: dict, sampled: list[int]) -> None:
    """The record holds every sampled id and the constraint; decoding its context again with its seed and
    constraint gives the same ids, and rescoring them under the rebuilt masks gives the recorded log-probs."""
    loaded = live.app.state.holder.current
    chat, sampling = loaded.chat, record["sampling"]
    ids, mask, logprobs = record["token_ids"], record["action_mask"], record["sample_logprobs"]
    assert [t for t, m in zip(ids, mask) if m] == sampled
    constraint = OutputConstraint.from_record(sampling["constraint"])

    def constrained():
        return Constrained(constraint, loaded.tokenizer, chat.im_end_id)

    context = ids[: record["prompt_length"]]
    generator = torch.Generator().manual_seed(sampling["seed"])
    again = Request(
        context, sampling["temperature"], sampling["top_p"], sampling["max_tokens"], generator, constraint=constrained()
    )
    batch = ContinuousBatch(loaded.model, stop_id=chat.im_end_id, pad_id=chat.pad_id)
    batch.add(again)
    while len(batch):
        batch.step()
    assert again.ids == sampled  # token-exact

    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    masks, replayed = constrained(), []
    settings = Sampling(temperature=sampling["temperature"], top_p=sampling["top_p"], max_new_tokens=1)
    for n in (n for n in range(len(ids)) if mask[n]):
        row = logits[n - 1].masked_fill(~masks.mask(logits.shape[-1]), float("-inf"))
        replayed.append(float(sampling_logprobs(row[None], settings)[0, ids[n]]))
        masks.advance(ids[n])
    recorded = [lp for lp, m in zip(logprobs, mask) if m]
    assert max(abs(a - b) for a, b in zip(replayed, recorded)) < 1e-4


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_calls_and_json_answers_are_constrained_and_replay_token_exact(tiny_checkpoints, tmp_path, engine):
    with make_server(tiny_checkpoints[0], tmp_path / "traces", engine=engine) as live:
        client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)

        def call(seed, tool_choice, session):
            return client.chat.completions.create(
                model="tiny",
                messages=USER,
                tools=TOOLS,
                tool_choice=tool_choice,
                max_tokens=MAX_TOKENS,
                seed=seed,
                extra_headers={"X-Session-Id": f"{session}-{seed}"},
                extra_body={"return_token_ids": True},
            )

        required, seed = _finished(lambda s: call(s, "required", "required"), "tool_calls")
        calls = required.choices[0].message.tool_calls
        assert calls and all(c.function.name in ("lookup", "send") for c in calls)
        assert all(isinstance(json.loads(c.function.arguments)["key"], str) for c in calls)  # its parameters
        record = _record(live, f"required-{seed}")
        assert record["sampling"]["constraint"]["several_calls"] is True  # parallel_tool_calls left out: true
        _replays(live, record, required.choices[0].model_extra["token_ids"])

        named = {"type": "function", "function": {"name": "send"}}
        sent, seed = _finished(lambda s: call(s, named, "named"), "tool_calls")
        [only] = sent.choices[0].message.tool_calls
        assert only.function.name == "send"
        record = _record(live, f"named-{seed}")
        assert [t["name"] for t in record["sampling"]["constraint"]["tools"]] == ["send"]
        _replays(live, record, sent.choices[0].model_extra["token_ids"])
        echo = [*USER, sent.choices[0].message.model_dump(exclude_none=True)]
        echo.append({"role": "tool", "tool_call_id": only.id, "content": "7"})
        follow = client.chat.completions.create(
            model="tiny", messages=echo, tools=TOOLS, max_tokens=3, extra_headers={"X-Session-Id": f"named-{seed}"}
        )
        assert follow.model_extra["lopd"]["trajectory_id"] == sent.model_extra["lopd"]["trajectory_id"]

        def parse(seed):
            return client.chat.completions.parse(
                model="tiny",
                messages=USER,
                response_format=Person,
                max_tokens=MAX_TOKENS,
                seed=seed,
                extra_headers={"X-Session-Id": f"person-{seed}"},
                extra_body={"return_token_ids": True},
            )

        parsed, seed = _finished(_tolerant(parse), "stop")
        assert isinstance(parsed.choices[0].message.parsed, Person)  # the client's own parse of the answer
        record = _record(live, f"person-{seed}")
        assert record["sampling"]["constraint"]["schema"]["required"] == ["name", "age", "tags"]
        assert json.loads(record["messages"][-1]["content"]) == parsed.choices[0].message.parsed.model_dump()
        _replays(live, record, parsed.choices[0].model_extra["token_ids"])


def _tolerant(parse):
    """`parse` raises when the answer ran out of max_tokens: that seed's answer is then one cut short."""

    def create(seed):
        try:
            return parse(seed)
        except openai.LengthFinishReasonError as exc:
            return exc.completion

    return create


def test_a_json_object_streams_and_a_call_or_an_answer_may_come_with_tools(live):
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)

    def stream(seed):
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=USER,
                response_format={"type": "json_object"},
                max_tokens=MAX_TOKENS,
                seed=seed,
                stream=True,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason

    for seed in range(12):
        text, finish = stream(seed)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            break
    else:
        raise AssertionError("no seed gave a whole JSON object")

    kinds = set()  # tools the model may call and a JSON answer: each turn is one of them
    for seed in range(8):
        r = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            assert all(c.function.name in ("lookup", "send") for c in choice.message.tool_calls)
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        kinds.add(choice.finish_reason)
    assert kinds & {"tool_calls", "stop"}, kinds


def _refused(live, body: dict, param: str, words: str, path="/chat/completions") -> None:
    response = httpx.post(live.url + path, json={"messages": USER, "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_what_cannot_be_enforced_is_refused_by_name(live):
    named = {"type": "function", "function": {"name": "nowhere"}}
    _refused(live, {"tools": TOOLS, "tool_choice": named}, "tool_choice", "'nowhere'")
    _refused(live, {"tool_choice": "required"}, "tool_choice", "needs tools")
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "age", "schema": schema}}}
    _refused(live, body, "response_format.json_schema.schema", "schema.properties.age.minimum")
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": {"type": "array"}}}}
    _refused(live, body, "response_format.json_schema.schema", '"type": "object"')
    _refused(live, {"response_format": {"type": "grammar"}}, "response_format.type", "")
    response = httpx.post(
        live.url + "/completions", json={"prompt": "hi", "response_format": {"type": "json_object"}}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"

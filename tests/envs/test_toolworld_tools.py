"""Tool declaration, schema derivation, validation, call parsing and malformed calls."""

from __future__ import annotations

import json
from typing import Literal

from _toolworld_fixtures import tasks

from lopd_core.envs import format_call, make_env, make_tasks, parse_action, tool_schemas
from lopd_core.envs.toolworld.tools import derive_schema, observation_text, tool, validate_arguments


def _task(template="bank_pay_payee", world="aurora"):
    return next(t for t in tasks("train") if t.template == template and t.world == world)


def _step(action, template="bank_pay_payee", world="aurora"):
    task = _task(template, world)
    env = make_env(task)
    env.reset(task)
    return env.step(action), env


def test_schema_from_signature_and_docstring():
    @tool
    def demo_book(
        self,
        room: str,
        nights: int,
        kind: Literal["single", "double"] = "single",
        tags: list[str] = (),
        vip: bool = False,
        budget: float = 0.0,
    ) -> dict:
        """Book a room.

        Args:
            room: room id
            nights: how many nights
            kind: room kind

        Returns:
            the booking
        """

    s = derive_schema(demo_book)
    assert s["name"] == "demo_book" and s["description"] == "Book a room."
    props = s["parameters"]["properties"]
    assert list(props) == ["room", "nights", "kind", "tags", "vip", "budget"]
    assert props["room"] == {"type": "string", "description": "room id"}
    assert props["nights"]["type"] == "integer" and props["nights"]["description"] == "how many nights"
    assert props["kind"]["enum"] == ["single", "double"] and props["kind"]["type"] == "string"
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["vip"]["type"] == "boolean" and props["budget"]["type"] == "number"
    assert "Returns" not in props and "description" not in props["vip"]
    assert s["parameters"]["required"] == ["room", "nights"]
    assert s["parameters"]["additionalProperties"] is False
    # the validator
    assert validate_arguments(s, {"room": "r1", "nights": 2}) is None
    assert "bad type" in validate_arguments(s, {"room": "r1", "nights": True})  # bool is not an integer
    assert "bad type" in validate_arguments(s, {"room": "r1", "nights": 2.0})
    assert "bad type" in validate_arguments(s, {"room": "r1", "nights": 2, "budget": False})
    assert validate_arguments(s, {"room": "r1", "nights": 2, "budget": 3}) is None
    assert "bad value" in validate_arguments(s, {"room": "r1", "nights": 2, "kind": "suite"})
    assert "missing" in validate_arguments(s, {"room": "r1"})
    assert "unexpected" in validate_arguments(s, {"room": "r1", "nights": 1, "x": 1})
    assert "bad type" in validate_arguments(s, {"room": "r1", "nights": 1, "tags": [1]})


def test_real_tool_schema():
    bank = {s["name"]: s for s in tool_schemas("bank")}
    t = bank["bank_transfer"]
    assert list(t["parameters"]["properties"]) == ["src", "dst", "amount"]
    assert t["parameters"]["properties"]["amount"]["type"] == "integer"
    assert t["description"] and all(p.get("description") for p in t["parameters"]["properties"].values())


def test_format_and_parse_round_trip():
    text = format_call("bank_transfer", {"amount": 40, "dst": "a7", "src": "a12"})
    assert (
        text
        == '<tool_call>{"name": "bank_transfer", "arguments": {"src": "a12", "dst": "a7", "amount": 40}}</tool_call>'
    )
    assert parse_action(text) == ("call", "bank_transfer", {"src": "a12", "dst": "a7", "amount": 40})
    assert parse_action("thinking... " + text)[0] == "call"
    assert parse_action("The balance is 40.") == ("answer", "The balance is 40.", None)
    assert parse_action(text + text)[0] == "error"
    assert parse_action('<tool_call>{"name": "a", "arguments": {}, "x": 1}</tool_call>')[0] == "error"


def test_malformed_calls_are_error_observations():
    cases = {
        "<tool_call>{not json}</tool_call>": "malformed json",
        '<tool_call>{"name": "bank_transfer"': "unclosed",
        '<tool_call>"bank_transfer"</tool_call>': "object",
        '<tool_call>{"arguments": {}}</tool_call>': "missing tool name",
        '<tool_call>{"name": "bank_steal", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "__class__", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "__init__", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "_pay", "arguments": {"kind": "x"}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "state", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "shop_search", "arguments": {"query": "mug"}}</tool_call>': "unknown tool",  # other domain
        format_call("bank_get_balance", {}): "missing argument: account",
        format_call("bank_get_balance", {"account": "a1", "pin": 1}): "unexpected argument: pin",
        format_call("bank_get_balance", {"account": 7}): "bad type for account",
        format_call("bank_transfer", {"src": "a1", "dst": "a2", "amount": "40"}): "bad type for amount",
        format_call("bank_transfer", {"src": "a1", "dst": "a2", "amount": True}): "bad type for amount",
        '<tool_call>{"name": "bank_list_accounts", "arguments": [1]}</tool_call>': "arguments must be an object",
    }
    for action, expected in cases.items():
        r, env = _step(action)
        assert not r.done and r.reward == 0.0, action
        obs = json.loads(r.observation)
        assert set(obs) == {"error"} and expected in obs["error"], (action, obs)
        assert r.info["error"] == obs["error"] and env.episode[0]["error"] == obs["error"]
        assert not env.internal_errors


def test_unknown_ids_and_conventions_give_short_uninformative_errors():
    r, _ = _step(format_call("bank_get_balance", {"account": "a999"}))
    assert json.loads(r.observation) == {"error": "not found"}
    r, _ = _step(format_call("calendar_list_events", {"date": "05/03/2026"}), "calendar_cancel", "aurora")
    assert json.loads(r.observation) == {"error": "rejected"}
    r, _ = _step(format_call("files_list", {"folder": "notes"}), "files_remove", "borealis")
    assert json.loads(r.observation) == {"error": "rejected"}


def test_system_prompt_lists_only_task_domains():
    task = _task("cross_pay_and_tell")
    env = make_env(task)
    first = env.reset(task)
    assert first.system.startswith("tools: ") and "bank_transfer(src,dst,amount)" in first.system
    assert "msg_send_sms(to,text)" in first.system and "shop_" not in first.system
    assert first.user == task.instruction


def test_fuzzed_well_typed_calls_never_crash_a_tool():
    import random

    rng = random.Random(0)
    values = {
        "string": [
            "",
            "a1",
            "e3",
            "c5",
            "f2",
            "p4",
            "o1",
            "b1",
            "fl3",
            "h2",
            "notes",
            "/notes",
            "trash",
            "/trash",
            "OSL",
            "oslo",
            "2026-03-05",
            "05/03/2026",
            "31/02/2026",
            "Mia",
            "me",
            "x" * 50,
        ],
        "integer": [-5, 0, 1, 3, 9, 16, 40, 4000, 10**12],
    }
    for task in tasks("train")[::2]:
        env = make_env(task)
        env.reset(task)
        names = [s for d in task.spec["domains"] for s in tool_schemas(d)]
        for _ in range(task.max_turns - 1):
            schema = rng.choice(names)
            args = {k: rng.choice(values[p["type"]]) for k, p in schema["parameters"]["properties"].items()}
            r = env.step(format_call(schema["name"], args))
            json.loads(r.observation)
            if r.done:
                break
        assert not env.internal_errors, env.internal_errors


def test_records_name_themselves_before_their_id():
    payload = {"result": [{"id": "a1", "label": "checking"}, {"id": "a2", "owner": "Theo", "nested": {"id": "x"}}]}
    text = observation_text(payload)
    assert text == (
        '{"result": [{"label": "checking", "id": "a1"}, {"owner": "Theo", "nested": {"id": "x"}, "id": "a2"}]}'
    )
    assert json.loads(text) == payload  # the same content: only the order an agent reads it in changes
    task = next(t for t in make_tasks("toolworld", "train", 200, 0) if t.template == "bank_balance_answer")
    env = make_env(task)
    env.reset(task)
    first = env.step('<tool_call>{"name": "bank_list_accounts", "arguments": {}}</tool_call>').observation
    record = json.loads(first)["result"][0]
    assert list(record)[-1] == "id" and len(record) > 1

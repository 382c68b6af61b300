"""The declarative tool environment: schemas from functions and specs, dispatch only through the declared table,
validated arguments, checks as data, reward = share of checks passed, and every task of the example package
solved by a scripted player, so every shipped task is winnable (the shared contract on them: test_contract.py)."""

import json

import pytest
from _plugin_fixture import NotesEnv
from _plugin_fixture import solve_library as solve

from lopd_core.envs import Task, format_call
from lopd_core.envs.declarative import DeclarativeToolEnv, ToolSpec, tool_table

library = pytest.importorskip("lopd_example_env.library", reason="install examples/lopd-example-env")
LibraryEnv = library.LibraryEnv


def notes_task(checks, state=None, max_turns=4):
    return Task(
        task_id="notes/t/0",
        env="notes",
        split="train",
        template="t",
        world="notes",
        instruction="Add a note.",
        spec={"state": state or {"notes": {}}, "checks": checks},
        max_turns=max_turns,
    )


def play(env_class, task, actions):
    env = env_class()
    env.reset(task)
    return env, [env.step(a) for a in actions]


def test_schemas_come_from_signatures_and_specs():
    schemas = {s["name"]: s for s in LibraryEnv.tool_schemas()}
    lend = schemas["lend_book"]["parameters"]
    assert list(lend["properties"]) == ["book", "member"] and lend["required"] == ["book", "member"]
    assert "state" not in lend["properties"] and lend["additionalProperties"] is False
    assert schemas["lend_book"]["description"] == "Lend a copy of a book to a member."
    assert lend["properties"]["member"] == {"type": "string", "description": "member id"}
    # the JSON-schema spec keeps its own text and is closed to extra arguments like the derived ones
    assert schemas["books_by"]["description"] == "Titles the library holds by an author."
    assert schemas["books_by"]["parameters"]["additionalProperties"] is False
    system = LibraryEnv().reset(LibraryEnv.make_tasks("train", 1, 0)[0]).system
    assert system.startswith("tools: find_book(title) find_member(name) lend_book(book,member)")


def test_bad_tool_declarations_fail_when_the_class_is_defined():
    def no_state(title: str) -> dict:
        return {}

    with pytest.raises(TypeError, match="first parameter must be `state`"):
        tool_table([no_state])
    with pytest.raises(TypeError, match="type must be one of"):
        tool_table(
            [
                ToolSpec(
                    {"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "tuple"}}}},
                    lambda state, x: x,
                )
            ]
        )
    with pytest.raises(TypeError, match="required must list declared"):
        tool_table(
            [
                ToolSpec(
                    {"name": "t", "parameters": {"type": "object", "properties": {}, "required": ["y"]}},
                    lambda state: 0,
                )
            ]
        )
    with pytest.raises(TypeError, match="declared twice"):
        tool_table([library.find_book, library.find_book])
    with pytest.raises(TypeError, match="needs a `name`"):
        type("Nameless", (DeclarativeToolEnv,), {"tools": ()})


def test_only_declared_tools_are_callable_and_bad_calls_are_observations():
    task = notes_task([{"op": "count", "path": ["notes"], "value": 0}], max_turns=20)
    probes = {
        "_count": "unknown tool",  # the spec's implementation is not itself a tool
        "__class__": "unknown tool",
        "reset": "unknown tool",
        "step": "unknown tool",
        "state": "unknown tool",
        "_table": "unknown tool",
        "validate_spec": "unknown tool",
    }
    env = NotesEnv()
    env.reset(task)
    for name, error in probes.items():
        r = env.step(format_call(name, {}))
        assert not r.done and r.info["error"] == error, name
    for arguments, error in [
        ({"title": "a"}, "missing argument: text"),
        ({"title": "a", "text": "b", "colour": "red"}, "unexpected argument: colour"),
        ({"title": 3, "text": "b"}, "bad type for title: expected string"),
        ({"title": "a", "text": "b", "tags": "x"}, "bad type for tags: expected array"),
    ]:
        r = env.step(format_call("add_note", arguments))
        assert r.info["error"] == error and json.loads(r.observation) == {"error": error}
    assert env.state() == {"notes": {}}  # no rejected call touched the state
    r = env.step(format_call("crash", {}))
    assert r.info["error"] == "failed" and env.internal_errors and "KeyError" in env.internal_errors[0]
    added = env.step(format_call("add_note", {"title": "a", "text": "b"}))
    assert added.observation == '{"result": {"status": "added"}}'
    assert env.step(format_call("add_note", {"title": "a", "text": "c"})).info["error"] == "exists"  # ToolError
    assert json.loads(env.step(format_call("count_notes", {})).observation) == {"result": 1}


def test_reward_is_the_share_of_checks_and_the_task_is_never_mutated():
    checks = [
        {"op": "present", "path": ["notes", "a"]},
        {"op": "eq", "path": ["notes", "a", "text"], "value": "hi"},
        {"op": "answer_contains", "value": "done"},
    ]
    task = notes_task(checks)
    before = task.to_json()
    _, (_, end) = play(NotesEnv, task, [format_call("add_note", {"title": "a", "text": "hello"}), "done."])
    assert end.done and end.reward == pytest.approx(2 / 3)
    assert end.info == {
        "success": False,
        "stop_reason": "answer",
        "checks_passed": 2,
        "checks_total": 3,
        "error": None,
        "call": None,
    }
    _, (_, win) = play(NotesEnv, task, [format_call("add_note", {"title": "a", "text": "hi"}), "done"])
    assert win.reward == 1.0 and win.info["success"]
    assert task.to_json() == before


def test_check_values_are_data_never_code():
    payload = "__import__('os').system('touch /tmp/lopd-pwned')"
    task = notes_task([{"op": "answer_eq", "value": payload}, {"op": "eq", "path": ["notes"], "value": payload}])
    _, (r,) = play(NotesEnv, task, [payload])
    assert r.info["checks_passed"] == 1  # the answer equals the string; nothing ran


@pytest.mark.parametrize(
    "spec, why",
    [
        ({"state": {}, "checks": [{"op": "eval", "value": "1"}]}, "unknown check op 'eval'"),
        ({"state": {}, "checks": [{"op": "eq", "path": ["a"]}]}, "needs path, value"),
        ({"state": {}, "checks": [{"op": "eq", "path": "a.b", "value": 1}]}, "path must be a list"),
        ({"state": {}, "checks": [{"op": "count", "path": [], "value": "2"}]}, "must be an integer"),
        ({"state": {}, "checks": []}, "non-empty list"),
        ({"state": [], "checks": [{"op": "present", "path": []}]}, "state must be an object"),
        ({"state": {}, "checks": [{"op": "present", "path": []}], "solution": "x"}, "unexpected key 'solution'"),
    ],
)
def test_task_specs_are_validated(spec, why):
    assert why in DeclarativeToolEnv.validate_spec(spec)


def test_every_example_task_can_be_won():
    for split in LibraryEnv.splits:
        tasks = LibraryEnv.make_tasks(split, 100, 0)
        assert tasks
        for task in tasks:
            env, results = play(LibraryEnv, task, solve(task))
            assert results[-1].info["success"] and results[-1].reward == 1.0, task.task_id
            assert not env.internal_errors

"""Task files as a careless or hostile author writes them (issue #30 items 7-9): every bad line is a `file:line`
TaskFileError at load, checks whose operands cannot meet fail at load rather than at the end of an episode, and
`max_turns` is bounded wherever a task gets one."""

import json
from types import SimpleNamespace

import pytest

from lopd_core.envs import Task, registry
from lopd_core.envs.declarative import DeclarativeToolEnv
from lopd_core.envs.task_files import TaskFileError, read_task_file
from lopd_core.envs.toolworld.checks import check_passes

GOOD = {
    "split": "train",
    "instruction": "Add a note.",
    "state": {"notes": {}, "name": "Ada"},
    "checks": [{"op": "present", "path": ["notes", "a"]}],
}


@pytest.fixture(autouse=True)
def clean_registry():
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def _file(tmp_path, second: bytes):
    """A task file whose line 1 is fine and line 2 is `second`."""
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + second + b"\n")
    return path


def _read(path):
    from _plugin_fixture import NotesEnv

    return read_task_file(path, "notes", validate_spec=NotesEnv.validate_spec)


def _line(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


# ---- item 8: lines that escaped TaskFileError --------------------------------------------------------------
@pytest.mark.parametrize(
    "second, why",
    [
        (
            b'{"split": "train", "instruction": "x", "state": {"deep": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b'}, "checks": [{"op": "present", "path": ["deep"]}]}',
            "nested deeper",
        ),
        (
            b'{"split": "train", "instruction": "x", "state": {"n": '
            + b"7" * 5000
            + b'}, "checks": [{"op": "present", "path": ["n"]}]}',
            "not plain JSON data",
        ),
        (_line(instruction="Caf\u00e9").replace(b"\\u00e9", b"\xe9"), "not UTF-8"),
        (_line(instruction="a \\ud800 b").replace(b"\\\\ud800", b"\\ud800"), "lone surrogate"),
        (_line(state={"x": 1}).replace(b"1}", b"NaN}"), "not plain JSON data"),
    ],
    ids=["100000-deep", "5000-digit-int", "latin-1-byte", "lone-surrogate", "nan"],
)
def test_every_bad_line_is_a_file_and_line_error_at_load(tmp_path, second, why):
    path = _file(tmp_path, second)
    with pytest.raises(TaskFileError) as caught:
        _read(path)
    message = str(caught.value)
    assert f"{path.name}:2: " in message and why in message and "\n" not in message


def test_a_depth_under_the_recursion_limit_is_refused_too(tmp_path):
    nested = {"x": 1}
    for _ in range(100):
        nested = {"x": nested}
    with pytest.raises(TaskFileError, match=r":2: nested deeper than"):
        _read(_file(tmp_path, _line(state=nested)))


# ---- item 7: checks' operand types, at load -------------------------------------------------------------
@pytest.mark.parametrize(
    "check, why",
    [
        ({"op": "contains", "path": ["name"], "value": 1}, "cannot be a substring"),
        ({"op": "contains", "path": ["notes"], "value": ["a"]}, "cannot be a key"),
        ({"op": "count", "path": ["name"], "value": 1}, "expected a list or object"),
        ({"op": "has", "path": ["name"], "value": {"a": 1}}, "expected a list or object"),
        ({"op": "answer_eq", "value": ["a"]}, "must be a string or a number"),
        ({"op": "count", "path": ["notes"], "value": -1}, ">= 0"),
    ],
)
def test_checks_whose_operands_cannot_meet_fail_at_load(tmp_path, check, why):
    with pytest.raises(TaskFileError, match=rf"tasks\.jsonl:2: checks\[0\]: .*{why}"):
        _read(_file(tmp_path, _line(checks=[check])))


def test_a_check_on_a_value_a_tool_changed_type_fails_instead_of_raising():
    check = {"op": "contains", "path": ["name"], "value": "Ada"}
    assert check_passes(check, {"name": "Ada Lovelace"}, None)
    for changed in (7, None, {"k": 1}, ["Ada"]):  # what a tool may leave at the path by the end of an episode
        assert check_passes(check, {"name": changed}, None) in (True, False)
    assert check_passes({"op": "contains", "path": ["d"], "value": [1]}, {"d": {"a": 1}}, None) is False


# ---- item 9: max_turns bounded ----------------------------------------------------------------------------
def test_max_turns_is_bounded_in_a_task_file_a_task_and_a_class(tmp_path):
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:2: max_turns must be an integer in \[1, \d+\]"):
        _read(_file(tmp_path, _line(max_turns=10**9)))
    with pytest.raises(ValueError, match="max_turns must be an integer"):
        Task(
            task_id="t", env="notes", split="train", template="t", world="w", instruction="i", spec={}, max_turns=10**9
        )
    with pytest.raises(TypeError, match="max_turns must be an integer"):
        type("Endless", (DeclarativeToolEnv,), {"name": "endless", "max_turns": 10**9})
    from lopd_core.envs.base import MAX_TURNS

    assert _read(_file(tmp_path, _line(max_turns=MAX_TURNS)))["train"][1].max_turns == MAX_TURNS

"""BFCL multi-turn on hand-made cases with known verdicts, and the executor's safety (no eval, allow-list).

Case: multi_turn_base_0 (file system + Twitter). Its ground truth:
  turn 0  cd(folder='document'), mkdir(dir_name='temp'), mv(source='final_report.pdf', destination='temp')
  turn 1  cd(folder='temp'), grep(file_name='final_report.pdf', pattern='budget analysis')
  turn 2  sort('final_report.pdf')
  turn 3  cd(folder='..'), mv(...previous_report.pdf -> temp), cd(folder='temp'), diff(...)
"""

from pathlib import Path

import pytest

from lopd_core.bench.bfcl.data import load_category, package_data_dir
from lopd_core.bench.bfcl.multi_turn import build_apis, check_multi_turn
from lopd_core.bench.bfcl.scoring import multi_turn_calls
from lopd_core.bench.tool_calls import ToolCall

DATA = package_data_dir()
pytestmark = pytest.mark.skipif(DATA is None or not DATA.is_dir(), reason="bfcl-eval is not installed")


@pytest.fixture(scope="module")
def entry():
    return load_category("multi_turn_base", DATA, 1)[0]


def verdict(entry, turns):
    return check_multi_turn(entry, multi_turn_calls({"id": entry.id, "turns": turns}), DATA)


def with_turn(entry, index, calls):
    turns = [list(t) for t in entry.answer]
    turns[index] = calls
    return turns


def test_ground_truth_passes(entry):
    assert verdict(entry, entry.answer).valid


@pytest.mark.parametrize(
    "turn,calls,valid,error_type",
    [
        # order matters here: mkdir before cd creates temp in the wrong folder, and the mv then fails
        (
            0,
            ["mkdir(dir_name='temp')", "cd(folder='document')", "mv(source='final_report.pdf', destination='temp')"],
            False,
            "state_mismatch",
        ),
        (
            0,
            [
                "cd(folder='document')",
                "mkdir(dir_name='temp')",
                "mv(source='final_report.pdf', destination='temp')",
                "ls()",
            ],
            True,
            "",
        ),  # an extra read-only call leaves the state equal: BFCL allows it
        (
            0,
            [
                "cd(folder='document')",
                "mkdir(dir_name='temp')",
                "mv(source='final_report.pdf', destination='temp')",
                "mkdir(dir_name='junk')",
            ],
            False,
            "state_mismatch",
        ),  # an extra call that changes the state
        (1, ["cd(folder='temp')"], False, "response_mismatch"),  # dropped grep: its result is missing
        (
            1,
            ["cd(folder='temp')", "grep(file_name='final_report.pdf', pattern='previous')"],
            False,
            "response_mismatch",
        ),  # wrong value: another pattern finds other lines
        (
            0,
            ["cd(folder='document')", "mkdir(dir_name='temp')", "move(source='final_report.pdf', destination='temp')"],
            False,
            "state_mismatch",
        ),  # wrong function name
        (
            0,
            ["cd(folder='document')", "mkdir(dir_name='temp')", "mv(source='final_report.pdf')"],
            False,
            "state_mismatch",
        ),  # missing required argument: the call errors, nothing moves
        (2, [], False, "empty_turn"),
        (2, ["sort(file_name='final_report.pdf')"], True, ""),  # keyword or positional, the same call
    ],
)
def test_known_verdicts(entry, turn, calls, valid, error_type):
    result = verdict(entry, with_turn(entry, turn, calls))
    assert (result.valid, result.error_type) == (valid, error_type), result.error


def test_turn_count_must_match(entry):
    assert verdict(entry, entry.answer[:-1]).error_type == "turn_count"


def test_only_declared_public_methods_are_callable(entry):
    apis = build_apis(entry, DATA)
    for name in ("_load_scenario", "__init__", "__class__", "eval", "not_a_tool"):
        assert "is not available" in apis.execute(ToolCall(name, {}))
    assert apis.execute(ToolCall("pwd", {})) == '{"current_working_directory": "/workspace"}'


def test_code_in_arguments_never_runs(entry, tmp_path):
    marker = tmp_path / "ran"
    apis = build_apis(entry, DATA)
    turns = [[f"cd(folder=__import__('pathlib').Path('{marker}').touch())"]] + [[] for _ in entry.answer[1:]]
    for call in multi_turn_calls({"id": entry.id, "turns": turns})[0]:
        apis.execute(call)  # the argument is the expression's text, a folder name that does not exist
    assert not Path(marker).exists()

"""What crosses back from the sandbox: builtin values only, compared in the parent; the pool; the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from lopd_core.envs.codegen import grade, same_value
from lopd_core.envs.sandbox import SandboxLimits, SandboxPool, run_calls, run_program

FAST = SandboxLimits(timeout_s=2, cpu_s=2, memory_mb=256)


def test_calls_report_values_and_errors_per_input():
    result = run_calls("def add(a, b):\n    return a + b\n", "add", [[1, 2], ["a", "b"], [1, "x"]], FAST)
    assert result.status == "ok"
    assert result.calls[:2] == [{"value": 3}, {"value": "ab"}]
    assert result.calls[2]["error"].startswith("TypeError")
    assert result.isolation["audit_hook"] is True and "rlimits" in result.isolation


def test_an_object_whose_eq_always_answers_true_proves_nothing():
    source = """
class Yes:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False

class SneakyInt(int):
    def __eq__(self, other):
        return True

def answer(x):
    return Yes() if x == 0 else SneakyInt(7)
"""
    result = run_calls(source, "answer", [[0], [1]], FAST)
    assert "not a builtin value" in result.calls[0]["error"]
    assert result.calls[1] == {"value": 7}  # serialized as the int it really is
    verdict = grade(source, "answer", [{"args": [0], "expected": 42}, {"args": [1], "expected": 42}], FAST)
    assert verdict.passed == 0


def test_objects_whose_repr_or_str_raise():
    source = """
class Bad:
    def __repr__(self):
        raise RuntimeError('no repr')
    __str__ = __repr__

class BadError(Exception):
    def __str__(self):
        raise RuntimeError('no str')

def f(x):
    if x:
        raise BadError()
    return Bad()
"""
    result = run_calls(source, "f", [[0], [1]], FAST)
    assert "not a builtin value" in result.calls[0]["error"]
    assert result.calls[1]["error"] == "BadError: <unprintable>"


def test_exiting_early_leaves_calls_without_result():
    result = run_calls("import os\ndef f(x):\n    os._exit(0)\n", "f", [[1], [2]], FAST)
    assert all("no result" in c["error"] for c in result.calls)
    verdict = grade("import os\ndef f(x):\n    os._exit(0)\n", "f", [{"args": [1], "expected": 1}], FAST)
    assert verdict.passed == 0 and "ended the program" in verdict.feedback


def test_same_value_is_strict_about_types_and_tolerant_about_floats():
    assert same_value(1, 1) and same_value(0.1 + 0.2, 0.3) and same_value(2, 2.0)
    assert not same_value(True, 1) and not same_value(1, True) and not same_value("1", 1)
    assert not same_value([1, 2], [1, 2, 3]) and same_value({"a": [1]}, {"a": [1]})
    assert not same_value(None, 0) and same_value(None, None)


def test_program_mode_reports_output_and_status():
    result = run_program("print('hello')\nraise ValueError('boom')", FAST)
    assert result.status == "error" and result.stdout == "hello\n"
    assert result.error == "ValueError: boom" and "Traceback" not in result.stderr


def test_pool_runs_in_parallel_and_keeps_order():
    sources = [f"print({i})" for i in range(6)]
    with SandboxPool(workers=2) as pool:
        results = pool.map_programs(sources, FAST)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert all(not Path(r.workdir).exists() for r in results)


def test_cli_sandbox_run_prints_json(tmp_path, capsys):
    from lopd_cli.main import main

    script = tmp_path / "loop.py"
    script.write_text("print('started', flush=True)\nwhile True:\n    pass\n")
    assert main(["sandbox", "run", str(script), "--timeout", "1", "--memory-mb", "128"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "timeout" and shown["stop_reason"] in ("wall_clock", "cpu_limit")
    assert shown["stdout"] == "started\n" and shown["isolation"]["rlimits"]["memory_mb"] == 128
    ok = tmp_path / "ok.py"
    ok.write_text("print(6 * 7)\n")
    assert main(["sandbox", "run", str(ok)]) == 0
    assert json.loads(capsys.readouterr().out)["stdout"] == "42\n"

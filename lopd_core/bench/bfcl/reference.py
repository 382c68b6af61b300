"""BFCL's own checker, imported for comparison with ours (tests and scripts/bfcl_agreement.py; never for scoring).

Importing `bfcl_eval`'s checker pulls `bfcl_eval.constants.model_config`, which imports every model vendor's
SDK. A stub module put in `sys.modules` first stands in for it: the AST checker only asks it whether a model
rewrites dots in function names (here: no, names are compared as given).

Multi-turn: BFCL's multi_turn_checker executes call strings with `eval`. We do not run `eval` on data, so the
comparison swaps its executor for ours (the same simulated API classes, reached through their declared methods)
and compares everything else: the turn loop, the empty-turn rule, the state check and the response check. An
unparseable call string becomes an error result, as a failing `eval` does in BFCL.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from lopd_core.bench.bfcl.answers import ground_truth_prediction
from lopd_core.bench.bfcl.data import BfclEntry
from lopd_core.bench.bfcl.multi_turn import ERROR_PREFIX, SimulatedApis, declared_methods
from lopd_core.bench.bfcl.mutations import mutations
from lopd_core.bench.bfcl.scoring import verdict_for
from lopd_core.bench.predictions import single_turn_calls
from lopd_core.bench.results import Verdict, fail
from lopd_core.bench.tool_calls import CallParseError, ToolCall, parse_call_string

_STUB = "bfcl_eval.constants.model_config"
REFERENCE_MODEL = "lopd-reference"


class _NoRewrite:
    underscore_to_dot = False


class _AnyModel(dict):
    def __missing__(self, key):
        return _NoRewrite()


def import_reference():
    """(ast_checker module, multi_turn_checker module, Language); ImportError when bfcl-eval is absent."""
    if _STUB not in sys.modules:
        stub = types.ModuleType(_STUB)
        stub.MODEL_CONFIG_MAPPING = _AnyModel()
        sys.modules[_STUB] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval import ast_checker
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker

    return ast_checker, multi_turn_checker, Language


def reference_single_turn(entry: BfclEntry, calls: list[ToolCall]) -> Verdict:
    """BFCL's verdict on decoded calls (relevance categories: "is any call made", as its runner decides)."""
    decoded = [{c.name: dict(c.arguments)} for c in calls]
    if entry.answer is None:
        made_call = len(decoded) > 0
        wanted = entry.category == "live_relevance"
        return Verdict(True) if made_call == wanted else fail("relevance", "")
    ast_checker, _, language = import_reference()
    result = ast_checker.ast_checker(
        entry.functions, decoded, entry.answer, language.PYTHON, entry.category, REFERENCE_MODEL
    )
    return Verdict(bool(result["valid"]), str(result.get("error", ""))[:300], str(result.get("error_type", "")))


class _SafeExecutor:
    """Stands in for BFCL's execute_multi_turn_func_call: same signature, same instance reuse across turns
    (BFCL keeps instances per model name and test id), but calls go through SimulatedApis, not `eval`."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.sessions: dict[tuple[str, str], SimulatedApis] = {}

    def __call__(
        self,
        func_call_list,
        initial_config,
        involved_classes,
        model_name,
        test_entry_id,
        long_context=False,
        is_evaL_run=False,
    ):
        key = (model_name, test_entry_id)
        if key not in self.sessions:
            self.sessions[key] = SimulatedApis(
                involved_classes, initial_config, declared_methods(self.data_dir, involved_classes), long_context
            )
        apis = self.sessions[key]
        results = []
        for text in func_call_list:
            try:
                results.append(apis.execute(parse_call_string(text)))
            except CallParseError as exc:
                results.append(f"{ERROR_PREFIX}{exc}")
        return results, apis.instances


def _parses(text: str) -> bool:
    try:
        parse_call_string(text)
        return True
    except CallParseError:
        return False


def reference_multi_turn(entry: BfclEntry, turns: list[list[str]], data_dir: Path) -> Verdict:
    """BFCL's multi_turn_checker on call strings per turn (one decoded step per turn), with our executor."""
    _, multi_turn_checker, _ = import_reference()
    if len(turns) != len(entry.answer):  # BFCL's runner fails these before the checker ("force-terminated")
        return fail("turn_count", "")
    turns = [[s for s in turn if _parses(s)] for turn in turns]  # BFCL drops what it cannot decode
    decoded = [[turn] if turn else [] for turn in turns]
    test_entry = {"id": entry.id, "initial_config": entry.initial_config, "involved_classes": entry.involved_classes}
    original = multi_turn_checker.execute_multi_turn_func_call
    multi_turn_checker.execute_multi_turn_func_call = _SafeExecutor(data_dir)
    try:
        result = multi_turn_checker.multi_turn_checker(
            decoded, entry.answer, test_entry, entry.category, REFERENCE_MODEL
        )
    finally:
        multi_turn_checker.execute_multi_turn_func_call = original
    return Verdict(bool(result["valid"]), str(result.get("error_message", ""))[:300], str(result.get("error_type", "")))


def reference_verdict(entry: BfclEntry, record: dict, data_dir: Path) -> Verdict:
    if entry.multi_turn:
        turns = [
            [c if isinstance(c, str) else ToolCall(c["name"], c.get("arguments", {})).python_source() for c in turn]
            for turn in record["turns"]
        ]
        return reference_multi_turn(entry, turns, data_dir)
    return reference_single_turn(entry, single_turn_calls(record))


def compare(entry: BfclEntry, data_dir: Path) -> list[tuple[str, bool, bool | None]]:
    """(case kind, our verdict, BFCL's verdict or None where BFCL's checker raised) for the ground truth and
    every mutation of one test case."""
    cases = [("ground_truth", ground_truth_prediction(entry))] + [(m.kind, m.prediction) for m in mutations(entry)]
    out = []
    for kind, record in cases:
        ours = verdict_for(entry, record, data_dir).valid
        try:
            theirs = reference_verdict(entry, record, data_dir).valid
        except Exception:  # noqa: BLE001 — their checker crashing on an input is a finding, not a reason to stop
            theirs = None
        out.append((kind, ours, theirs))
    return out

"""BFCL multi-turn: the package's simulated APIs, driven without `eval`, and the per-turn state check.

A multi-turn test case names the simulated API classes it involves (a file system, a trading bot, a travel
agency, ...) and their initial state. Two copies are built from that state: one receives the model's calls,
the other the ground-truth calls, turn by turn. After each turn whose ground truth is not empty:
  * the model must have made at least one call in that turn;
  * every involved instance must equal its ground-truth twin on its public attributes (the state check);
  * the results of the turn's ground-truth calls must all appear (as a multiset, any order) among the results
    of every model call so far (the response check: a read the model already did earlier still counts).
Turns whose ground truth is empty (miss_func / miss_param: the request cannot be served yet) are not checked,
but the model's calls there still run, so a wrong call changes the state later turns are compared on.
These are BFCL's rules (its multi_turn_checker); the model may make extra calls as long as they leave the
state equal.

How calls run: BFCL rewrites each call string and hands it to `eval`. Here a call is parsed with `ast` into a
name and literal arguments (tool_calls.py) and dispatched only to a method that the class's function document
declares and that is public on the instance; anything else becomes an error result, as a failing call does in
BFCL ("Error during execution: ..."). Results are rendered as BFCL renders them (str as is, dict as JSON, else
str()), because the response check compares those strings.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

from lopd_core.bench.bfcl.data import PACKAGE_HINT, BfclEntry, multi_turn_docs
from lopd_core.bench.results import PASS, Verdict, fail
from lopd_core.bench.tool_calls import CallParseError, ToolCall, parse_call_string

_SOURCE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
API_MODULES = {
    "GorillaFileSystem": f"{_SOURCE}.gorilla_file_system",
    "MathAPI": f"{_SOURCE}.math_api",
    "MessageAPI": f"{_SOURCE}.message_api",
    "TwitterAPI": f"{_SOURCE}.posting_api",
    "TicketAPI": f"{_SOURCE}.ticket_api",
    "TradingBot": f"{_SOURCE}.trading_bot",
    "TravelAPI": f"{_SOURCE}.travel_booking",
    "VehicleControlAPI": f"{_SOURCE}.vehicle_control",
}
STATELESS = ("MathAPI",)  # built without an initial state
ERROR_PREFIX = "Error during execution: "


class SimulatedApiUnavailable(ImportError):
    """The simulated API classes come from the bfcl-eval package, which is not installed."""


def api_class(name: str) -> type:
    if name not in API_MODULES:
        raise ValueError(f"unknown simulated API class {name!r}; known: {', '.join(API_MODULES)}")
    try:
        module = importlib.import_module(API_MODULES[name])
    except ModuleNotFoundError as exc:
        raise SimulatedApiUnavailable(f"multi-turn BFCL needs the bfcl-eval package ({PACKAGE_HINT}): {exc}") from None
    return getattr(module, name)


def render_result(result) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


class SimulatedApis:
    """The API instances of one test case, callable only through their declared methods."""

    def __init__(
        self, classes: list[str], initial_config: dict, declared: dict[str, list[str]], long_context: bool = False
    ):
        self.instances: dict[str, object] = {}
        self._methods: dict[str, object] = {}
        for name in classes:
            instance = api_class(name)()
            if name not in STATELESS:
                instance._load_scenario(copy.deepcopy(initial_config.get(name, {})), long_context=long_context)
            self.instances[name] = instance
            for method_name in declared.get(name, []):  # a later class wins a shared name, as in BFCL
                method = getattr(instance, method_name, None) if not method_name.startswith("_") else None
                if callable(method):
                    self._methods[method_name] = method

    def execute(self, call: ToolCall) -> str:
        method = self._methods.get(call.name)
        if method is None:
            return f"{ERROR_PREFIX}function {call.name!r} is not available"
        try:
            return render_result(method(*call.positional, **call.arguments))
        except Exception as exc:  # noqa: BLE001 — a bad call is an observation for the model, not a crash of the benchmark
            return f"{ERROR_PREFIX}{exc}"


def declared_methods(data_dir: Path, classes: list[str]) -> dict[str, list[str]]:
    """Method names per class as its function document declares them (the allow-list)."""
    return {cls: [doc["name"] for doc in multi_turn_docs(data_dir, [cls])] for cls in classes}


def build_apis(entry: BfclEntry, data_dir: Path) -> SimulatedApis:
    return SimulatedApis(
        entry.involved_classes,
        entry.initial_config,
        declared_methods(data_dir, entry.involved_classes),
        long_context="long_context" in entry.category,
    )


def truth_calls(entry: BfclEntry) -> list[list[ToolCall]]:
    """The ground-truth calls of each turn, parsed (the answers are Python call strings)."""
    try:
        return [[parse_call_string(s) for s in turn] for turn in entry.answer]
    except CallParseError as exc:
        raise ValueError(f"{entry.id}: unreadable ground-truth call: {exc}") from None


def _state_differences(model_instance: object, truth_instance: object) -> list[str]:
    different = []
    for attr, truth_value in vars(truth_instance).items():
        if attr.startswith("_"):
            continue
        if not hasattr(model_instance, attr) or getattr(model_instance, attr) != truth_value:
            different.append(attr)
    return different


def _missing_results(truth_results: list[str], model_results: list[str]) -> list[str]:
    pool = list(model_results)
    missing = []
    for item in truth_results:
        if item in pool:
            pool.remove(item)
        else:
            missing.append(item)
    return missing


def check_multi_turn(entry: BfclEntry, model_turns: list[list[ToolCall]], data_dir: Path) -> Verdict:
    """BFCL's verdict for one multi-turn test case, given the model's calls per turn."""
    if len(model_turns) != len(entry.answer):
        return fail("turn_count", f"expected {len(entry.answer)} turns, got {len(model_turns)}")
    model_apis, truth_apis = build_apis(entry, data_dir), build_apis(entry, data_dir)
    model_results_so_far: list[str] = []
    for turn, (calls, expected) in enumerate(zip(model_turns, truth_calls(entry))):
        model_results_so_far.extend(model_apis.execute(c) for c in calls)
        truth_results = [truth_apis.execute(c) for c in expected]
        if not expected:
            continue
        if not calls:
            return fail("empty_turn", f"turn {turn}: no call, expected {len(expected)}")
        for cls, truth_instance in truth_apis.instances.items():
            different = _state_differences(model_apis.instances[cls], truth_instance)
            if different:
                return fail("state_mismatch", f"turn {turn}: {cls} differs from the ground truth in {different}")
        missing = _missing_results(truth_results, model_results_so_far)
        if missing:
            return fail(
                "response_mismatch",
                f"turn {turn}: {len(missing)} ground-truth results not produced, e.g. {missing[0][:200]!r}",
            )
    return PASS

"""Predictions files: one JSON object per line, `id` plus the model's answer (shared by BFCL and ACEBench).

The answer is `calls` — a list of `{"name": ..., "arguments": {...}}` (or Python call strings) — or `text`,
the model's raw output, parsed as in live evaluation (tool_calls.parse_calls; text without a call is no call).
Multi-turn BFCL records carry `turns` instead (bfcl/scoring.py).
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.bench.results import Verdict, fail, read_jsonl
from lopd_core.bench.tool_calls import CallParseError, ToolCall, calls_or_none, parse_call_string


class PredictionError(ValueError):
    """A predictions record is not in the shape `lopd bench score` reads."""


def read_predictions(path: str | Path) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for number, record in enumerate(read_jsonl(path, PredictionError), 1):
        if not isinstance(record, dict) or "id" not in record:
            raise PredictionError(f"{path}: record {number} is not an object with an 'id'")
        records[str(record["id"])] = record
    return records


def judge_all(entries: list, predictions: dict[str, dict], judge, partial: bool = False) -> dict[str, Verdict]:
    """`judge(entry, record)` for every test case (id -> verdict). A case without a record fails
    (`missing_prediction`), or is left out with `partial`; a file that matches none of the ids is an error."""
    if entries and predictions and not any(e.id in predictions for e in entries):
        raise PredictionError(
            f"no prediction matches an id of category {entries[0].category!r} (e.g. {entries[0].id!r})"
        )
    verdicts: dict[str, Verdict] = {}
    for entry in entries:
        record = predictions.get(entry.id)
        if record is not None:
            verdicts[entry.id] = judge(entry, record)
        elif not partial:
            verdicts[entry.id] = fail("missing_prediction", "no prediction for this id")
    return verdicts


def _call(obj, where: str) -> ToolCall:
    if isinstance(obj, str):
        return parse_call_string(obj)
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments", {}), dict)):
        raise PredictionError(f"{where}: a call must be {{'name': str, 'arguments': {{...}}}}, got {obj!r:.200}")
    return ToolCall(obj["name"], obj.get("arguments", {}))


def calls_of(items: list, where: str) -> list[ToolCall]:
    calls = []
    for item in items:
        call = _parse_or_none(item) if isinstance(item, str) else _call(item, where)
        if call is not None:
            calls.append(call)
    return calls


def _parse_or_none(text: str) -> ToolCall | None:
    try:
        return parse_call_string(text)
    except CallParseError:
        return None


def single_turn_calls(record: dict) -> list[ToolCall]:
    if "calls" in record:
        if not isinstance(record["calls"], list):
            raise PredictionError(f"{record['id']}: 'calls' must be a list")
        return calls_of(record["calls"], str(record["id"]))
    if "text" in record:
        return calls_or_none(str(record["text"]))
    raise PredictionError(f"{record['id']}: a single-turn record needs 'calls' or 'text'")

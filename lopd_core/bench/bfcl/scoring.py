"""Score BFCL predictions: one JSONL record per test case, one verdict per record, accuracy per category.

A predictions record is `{"id": ..., <one of>}`:
  * `calls`: `[{"name": ..., "arguments": {...}}]` — the calls of a single-turn case (`[]`: no call);
  * `text`: the model's raw output, parsed as in live evaluation (JSON tool-call syntax or Python syntax;
    text with no call means no call);
  * `turns`: multi-turn, one list per user turn of the calls made in it, each a Python call string as BFCL
    writes its answers (`"mv(source='a.txt', destination='tmp')"`) or a `{name, arguments}` object. A string
    that does not parse is skipped, as BFCL skips a model step it cannot decode.
A test case without a record fails (`missing_prediction`) unless scoring is partial.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.bench.bfcl.checker import check_single_turn
from lopd_core.bench.bfcl.data import BfclEntry
from lopd_core.bench.bfcl.multi_turn import check_multi_turn
from lopd_core.bench.predictions import PredictionError, calls_of, judge_all, single_turn_calls
from lopd_core.bench.results import Verdict, merge_metrics
from lopd_core.bench.tool_calls import ToolCall


def multi_turn_calls(record: dict) -> list[list[ToolCall]]:
    turns = record.get("turns")
    if not isinstance(turns, list) or not all(isinstance(t, list) for t in turns):
        raise PredictionError(f"{record['id']}: a multi-turn record needs 'turns': a list of lists of calls")
    return [calls_of(turn, str(record["id"])) for turn in turns]


def verdict_for(entry: BfclEntry, record: dict, data_dir: Path) -> Verdict:
    if entry.multi_turn:
        return check_multi_turn(entry, multi_turn_calls(record), data_dir)
    return check_single_turn(entry.category, entry.functions, single_turn_calls(record), entry.answer)


def score_entries(
    entries: list[BfclEntry], predictions: dict[str, dict], data_dir: Path, partial: bool = False
) -> dict[str, Verdict]:
    """Verdict per test case id. With `partial`, cases without a prediction are left out instead of failed."""
    return judge_all(entries, predictions, lambda e, r: verdict_for(e, r, data_dir), partial)


def with_mean(section: dict) -> dict:
    """Add `mean_accuracy`: the unweighted mean over the categories present (not BFCL's weighted overall)."""
    accuracies = [v["accuracy"] for k, v in section.items() if k != "mean_accuracy" and isinstance(v, dict)]
    section["mean_accuracy"] = {
        "accuracy": round(sum(accuracies) / len(accuracies), 4) if accuracies else 0.0,
        "categories": len(accuracies),
    }
    return section


def write_scores(path: str | Path, scores: dict) -> Path:
    """Merge category scores into metrics/eval.json under "bfcl" (only numbers: error counts stay out)."""
    public = {c: {k: v for k, v in s.items() if k != "errors"} for c, s in scores.items() if c != "mean_accuracy"}
    return merge_metrics(path, "bfcl", public, finish=with_mean)

"""Score ACEBench predictions the way ACEBench reports them.

A predictions record is `{"id": ..., "calls": [{"name", "arguments"}]}` or `{"id": ..., "text": "..."}` (the
raw output: parsed into calls for normal categories — Python or JSON call syntax —, read as text for special
ones). Scores per category:
  * most categories: accuracy = passed / cases;
  * the multi-turn categories (normal_multi_turn_user_adjust / _switch) are slices of conversations: accuracy
    counts a conversation only when every slice passes, and process_accuracy averages the share of passing
    slices per conversation (ACEBench's end and process accuracy);
  * summaries: normal_summary and special_summary, the unweighted means over the categories of each group
    that were scored, as ACEBench's table computes them. ACEBench's overall score weights normal, special and
    agent (0.578 / 0.2676 / 0.1545); without the agent categories we do not report it.
"""

from __future__ import annotations

from pathlib import Path

from lopd_core.bench.acebench.checker import (
    ERROR_PHRASE,
    INCOMPLETE_PHRASE,
    base_name,
    check_normal,
    check_special,
    find_doc,
    parameter_schema,
)
from lopd_core.bench.acebench.data import NORMAL, SPECIAL, AceEntry
from lopd_core.bench.predictions import PredictionError, judge_all, single_turn_calls
from lopd_core.bench.results import Verdict, accuracy_summary, merge_metrics
from lopd_core.bench.tool_calls import ToolCall


def verdict_for(entry: AceEntry, record: dict) -> Verdict:
    if entry.category in SPECIAL:
        if "text" not in record:
            raise PredictionError(f"{entry.id}: special categories are answered with 'text'")
        return check_special(entry.category, str(record["text"]), entry.answer)
    return check_normal(entry.functions, single_turn_calls(record), entry.answer)


def score_entries(entries: list[AceEntry], predictions: dict[str, dict], partial: bool = False) -> dict[str, Verdict]:
    return judge_all(entries, predictions, verdict_for, partial)


def category_scores(entries: list[AceEntry], verdicts: dict[str, Verdict]) -> dict:
    summary = accuracy_summary(verdicts)
    if entries and "multi_turn" in entries[0].category:
        conversations: dict[str, list[bool]] = {}
        for entry in entries:
            if entry.id in verdicts:
                conversations.setdefault(entry.conversation, []).append(verdicts[entry.id].valid)
        n = len(conversations)
        summary.update(
            {
                "accuracy": round(sum(all(v) for v in conversations.values()) / n, 4) if n else 0.0,
                "process_accuracy": round(sum(sum(v) / len(v) for v in conversations.values()) / n, 4) if n else 0.0,
                "conversations": n,
            }
        )
    return summary


def with_summaries(section: dict) -> dict:
    """Add normal_summary / special_summary to one language's scores (unweighted means, as ACEBench's)."""
    for name, group in (("normal_summary", NORMAL), ("special_summary", SPECIAL)):
        scored = [section[c]["accuracy"] for c in group if isinstance(section.get(c), dict)]
        if scored:
            section[name] = {"accuracy": round(sum(scored) / len(scored), 4), "categories": len(scored)}
    return section


def ground_truth_prediction(entry: AceEntry) -> dict:
    """What a perfect model answers: the first alternative's calls, or the text ACEBench's prompts ask for."""
    answer = entry.answer
    if entry.category == "special_irrelevant":
        return {"id": entry.id, "text": str(answer)}
    if entry.category == "special_incomplete":
        ((name, params),) = answer.items()
        return {"id": entry.id, "text": f'["{INCOMPLETE_PHRASE} ({", ".join(params)}) for the api ({name})"]'}
    if entry.category == "special_error_param":
        values = [str(v) for vs in answer.values() for v in vs]
        return {
            "id": entry.id,
            "text": f'["{ERROR_PHRASE} ({", ".join(values)}) for the parameters '
            f'({", ".join(answer)}) in the conversation history."]',
        }
    first = answer[0] if isinstance(answer, list) else answer
    return {"id": entry.id, "calls": [ToolCall(base_name(k, entry.functions), v).to_dict() for k, v in first.items()]}


def unsatisfiable_ids(entries: list[AceEntry]) -> list[str]:
    """Normal cases whose answer leaves out a parameter the document requires: a call without it fails the
    required check, a call with it is an unexpected parameter (one zh case; a slip in the data)."""
    bad = []
    for entry in entries:
        if entry.category in SPECIAL:
            continue
        first = entry.answer[0] if isinstance(entry.answer, list) else entry.answer
        for key, params in first.items():
            doc = find_doc(entry.functions, key) or {}
            if any(p not in params for p in parameter_schema(doc).get("required", [])):
                bad.append(entry.id)
                break
    return bad


def write_scores(path: str | Path, scores: dict) -> Path:
    """Merge {language: {category: scores}} into metrics/eval.json under "acebench" (summaries recomputed over
    every category present; error counts stay out)."""
    for language, section in scores.items():
        public = {
            c: {k: v for k, v in s.items() if k != "errors"} for c, s in section.items() if not c.endswith("_summary")
        }
        merge_metrics(path, "acebench", public, under=language, finish=with_summaries)
    return Path(path)

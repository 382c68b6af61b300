"""The shape of one trace record: what a reader needs of a line before it assembles trajectories from it.

Why a check of its own: a line that parses as JSON but lacks a field (an edited store, a record of a future
version) would otherwise surface as a KeyError deep in assembly, with no file or line to repair. The reader
(`store.read_records`) and `lopd serve store check|repair` (repair.py) use the same rule, so whatever the reader
refuses, the repair can quarantine.
"""

from __future__ import annotations

import json

from lopd_core.traces.schema import FINISH_REASONS, ORIGINS

_NUMBER = (int, float)
# field -> the JSON types it may hold; a record may carry more fields than these (sampling, tools, checks, ...)
TURN_FIELDS = {
    "trajectory_id": (str,),
    "turn": (int,),
    "session": (str,),
    "model_version": (str,),
    "prompt_length": (int,),
    "token_ids": (list,),
    "action_mask": (list,),
    "sample_logprobs": (list,),
    "finish_reason": (str,),
    "messages": (list,),
    "time": _NUMBER,
}
FEEDBACK_FIELDS = {"trajectory_id": (str,), "reward": _NUMBER, "success": (bool,)}
KINDS = {"turn": TURN_FIELDS, "feedback": FEEDBACK_FIELDS}


def parse_record(raw: bytes) -> tuple[dict | None, str]:
    """A line as a record, or (None, why it is not one)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return None, f"unreadable JSON ({str(exc)[:80]})"
    if not isinstance(record, dict) or "kind" not in record:
        return None, "not a trace record (no `kind`)"
    fields = KINDS.get(record["kind"]) if isinstance(record["kind"], str) else None
    if fields is None:
        return None, f"unknown record kind {str(record['kind'])[:40]!r}"
    for name, types in fields.items():
        value = record.get(name)
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            return None, f"{record['kind']} record: field {name!r} missing or not a {types[0].__name__}"
    why = _turn_problem(record) if record["kind"] == "turn" else _feedback_problem(record)
    return (None, why) if why else (record, "")


def _turn_problem(rec: dict) -> str:
    """What the trace schema would refuse in this turn alone (schema.TRACE_SCHEMA), so one bad turn is found by
    its line rather than failing the validation of the whole table."""
    if rec["turn"] < 0 or (rec["turn"] == 0 and rec.get("origin") not in ORIGINS):
        return "turn record: a negative turn, or turn 0 without a known origin"
    carried = rec.get("carried_turns", 0)
    if not isinstance(carried, int) or isinstance(carried, bool) or carried < 0 or (carried and rec["turn"] != 0):
        return "turn record: `carried_turns` is not a non-negative integer on a turn 0"
    ids, mask, lps = rec["token_ids"], rec["action_mask"], rec["sample_logprobs"]
    if not len(ids) == len(mask) == len(lps):
        return "turn record: token_ids, action_mask and sample_logprobs differ in length"
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return "turn record: a token id that is not a non-negative integer"
    if not all(m in (0, 1) and not isinstance(m, bool) for m in mask):
        return "turn record: an action mask value other than 0 or 1"
    if not all(isinstance(v, _NUMBER) and not isinstance(v, bool) and v <= 1e-6 for v in lps):
        return "turn record: a sampling log-prob that is not a number <= 0"
    if rec["finish_reason"] not in FINISH_REASONS:
        return f"turn record: unknown finish_reason {rec['finish_reason'][:20]!r}"
    return ""


def _feedback_problem(rec: dict) -> str:
    if not 0.0 <= rec["reward"] <= 1.0 or (rec["success"] and rec["reward"] != 1.0):
        return "feedback record: a reward outside [0, 1], or a success with reward < 1"
    turns = rec.get("turns", 0)
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
        return "feedback record: `turns` is not a non-negative integer"
    return ""

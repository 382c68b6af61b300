"""`lopd serve store check DIR` and `lopd serve store repair DIR`: find the lines readers refuse, and set them aside.

Why: a reader refuses a store with a bad line (an edited segment, a record a failed write cut short in an older
version, a turn whose earlier turns were moved away), so one bad line would otherwise keep all its labeled
traffic out of training. `check` lists every problem with its segment, line and byte offset and changes
nothing. `repair` (the store's writer lock held: never beside a running server) moves each bad line to
`DIR/quarantine/repair-<stamp>.bad` (the raw bytes, one per line) with a JSON report beside it, and rewrites
each segment it touched without them (a temporary file renamed over it). A bad line that ends in a whole record
(a partial write followed by the next record on the same line) keeps that record: only the bytes before it are
quarantined. A torn last line is quarantined too: readers already skip it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lopd_core.traces.lock import WriterLock
from lopd_core.traces.records import parse_record
from lopd_core.traces.store import segments

RECORD_START = b'{"kind":'  # every record the store writes opens with its kind (json.dumps keeps key order)


@dataclass
class Problem:
    segment: str
    line: int  # 1-based
    offset: int  # byte offset of the line in its segment
    bytes: int
    why: str
    kept_bytes: int = 0  # the whole record found at the line's end, kept by a repair


def _salvage(raw: bytes) -> int:
    """The length of a whole record that ends `raw` after a cut-off one (0: none)."""
    start = raw.rfind(RECORD_START)
    if start <= 0:
        return 0
    record, _ = parse_record(raw[start:])
    return len(raw) - start if record is not None else 0


def _scan(path: Path, turns_seen: dict[str, int]) -> tuple[list[Problem], list[bytes]]:
    """The problems of one segment, and the lines a repair keeps (a salvaged record in place of its line)."""
    problems, kept = [], []
    data = path.read_bytes()
    offset = 0
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        last = number == len(lines)
        if last and not raw:
            break
        if raw.strip():
            record, why = parse_record(raw) if not last else (None, "torn last line (a write cut short)")
            if record is not None and record["kind"] == "turn":
                expected = turns_seen.get(record["trajectory_id"], 0)
                if record["turn"] != expected:
                    record, why = (
                        None,
                        f"turn {record['turn']} of {record['trajectory_id']} where turn {expected} was due",
                    )
                else:
                    turns_seen[record["trajectory_id"]] = expected + 1 + record.get("carried_turns", 0)
            if record is None:
                keep = _salvage(raw) if not last else 0
                problems.append(Problem(path.name, number, offset, len(raw), why, keep))
                if keep:
                    kept.append(raw[len(raw) - keep :])
            else:
                kept.append(raw)
        offset += len(raw) + 1
    return problems, kept


def check_store(store_dir: str | Path) -> list[Problem]:
    """Every line of the store a reader would refuse or skip; nothing is changed."""
    turns_seen: dict[str, int] = {}
    return [p for path in segments(store_dir) for p in _scan(path, turns_seen)[0]]


def repair_store(store_dir: str | Path) -> tuple[list[Problem], Path | None]:
    """Quarantine every problem line (see the module's docstring); returns the problems and the report's path
    (None when the store was clean). StoreLocked while a server writes to the store."""
    store_dir = Path(store_dir)
    lock = WriterLock(store_dir, purpose="lopd serve store repair")
    try:
        turns_seen: dict[str, int] = {}
        found: list[Problem] = []
        quarantine = store_dir / "quarantine"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        bad_path, report_path = quarantine / f"repair-{stamp}.bad", quarantine / f"repair-{stamp}.json"
        for path in segments(store_dir):
            problems, kept = _scan(path, turns_seen)
            if not problems:
                continue
            quarantine.mkdir(exist_ok=True)
            data = path.read_bytes()
            with open(bad_path, "ab") as bad:  # the bad bytes first: a crash mid-repair loses nothing
                for p in problems:
                    bad.write(data[p.offset : p.offset + p.bytes - p.kept_bytes] + b"\n")
                bad.flush()
                os.fsync(bad.fileno())
            tmp = path.with_name(path.name + ".repair-tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            found += problems
        if not found:
            return [], None
        report = {
            "store": str(store_dir),
            "time": time.time(),
            "quarantined": str(bad_path),
            "problems": [asdict(p) for p in found],
        }
        report_path.write_text(json.dumps(report, indent=2))
        return found, report_path
    finally:
        lock.release()

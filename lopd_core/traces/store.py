"""The trace store: append-only JSON lines in numbered segments, one fsync'd line per record.

Why this shape: a served conversation is worth keeping only if it survives the server. Each record is one line,
written, flushed and fsync'd before the request that produced it is answered, so a `kill -9` loses at most the
requests in flight; a line torn by the kill is the last of its segment, and reading skips it with a warning.
A reopened store never appends after a torn line: it starts the next segment.

Records (JSON objects, `kind` first):
  * `turn`     — one served turn of a trajectory: the segment of ids it added (forced ids of the request's new
                 messages, then the sampled ids) with their action mask and sampling log-probs, the model version,
                 the messages it added, the fingerprint of the tokenizer that made the ids (fingerprint.py); a
                 trajectory's turn 0 also names its session, origin, parent and tools.
  * `feedback` — a reward in [0, 1], success and optional check results for one trajectory, and the number of
                 its turns it judged (`turns`): a turn recorded after them clears the label on read, since nobody
                 judged it (the server starts a new trajectory after a label; this covers a turn in flight).
`read_traces` assembles the turns of each trajectory, in order, into one row of the trace table (schema.py).

Bound (stated, never a silent drop): a segment is closed at `segment_bytes` and the next one opened; once the
segments on disk hold `max_bytes`, `ensure_room` raises StoreFull and the server refuses new work with 503 until
the store is snapshot and cleared (or the bound raised). The bound is counted from disk, not from this process's
writes, so moving segments away frees room at once; a feedback record may go `feedback_bytes` past it, so the
conversations already answered can still be labeled. The check runs before a request starts, so the records of
requests already in flight may carry it past the bound by those records.

Faults: one writer per store (lock.py: a second server on the same folder is refused). A write that fails (a
full disk) is cut back to where its line began and raises DiskFull (the server answers 507): no partial line is
ever followed by another record. A bad line found later (an edited store) is refused by readers with its file
and line; `lopd serve store repair` (repair.py) quarantines it.

Snapshot: `snapshot(store_dir, out)` writes the validated trace table as one parquet file (atomically), the file
to `dvc add` or to name as a stage's out (`lopd serve snapshot --out FILE`, docs/serving.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from lopd_core.outputs import atomic_write, file_target
from lopd_core.traces.errors import DiskFull, StoreFull, TraceStoreError
from lopd_core.traces.lock import WriterLock
from lopd_core.traces.records import parse_record
from lopd_core.traces.schema import TRACE_SCHEMA, validate_traces

SEGMENT_GLOB = "traces-*.jsonl"
SEGMENT_NAME = re.compile(r"traces-(\d+)\.jsonl")
REPAIR_HINT = "`lopd serve store check DIR` lists every bad line, `lopd serve store repair DIR` quarantines them"


def _segment_name(number: int) -> str:
    return f"traces-{number:06d}.jsonl"


def segment_number(path: Path) -> int:
    match = SEGMENT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def segments(store_dir: str | Path) -> list[Path]:
    """The store's segments in order: files named traces-NNNNNN.jsonl (anything else in the folder, a stray
    file or a folder of that name, is not the store's and is left alone)."""
    found = [p for p in Path(store_dir).glob(SEGMENT_GLOB) if segment_number(p) >= 0 and p.is_file()]
    return sorted(found, key=segment_number)


def disk_bytes(store_dir: str | Path) -> int:
    """The bytes the store's segments hold on disk now, whoever wrote them (a segment moved away meanwhile
    counts 0)."""
    total = 0
    for path in segments(store_dir):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class TraceStore:
    """Appends records to the newest segment; thread-safe (one lock around write + fsync); the store's only
    writer while open (lock.py)."""

    def __init__(self, store_dir: str | Path, *, segment_bytes: int, max_bytes: int, feedback_bytes: int = 0):
        if segment_bytes <= 0 or max_bytes <= 0 or feedback_bytes < 0:
            raise ValueError("segment_bytes and max_bytes must be positive, feedback_bytes not negative")
        self.dir = Path(store_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise TraceStoreError(f"{self.dir}: a trace store is a folder, and this is a file (name a folder)")
        self.segment_bytes, self.max_bytes, self.feedback_bytes = segment_bytes, max_bytes, feedback_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._roll = False  # a failed write could not be undone: the next record starts a new segment
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = WriterLock(self.dir, purpose="a trace store writer")
        except PermissionError as exc:
            raise TraceStoreError(f"{self.dir}: the trace store is not writable ({exc.strerror})") from None
        try:
            existing = segments(self.dir)
            number = segment_number(existing[-1]) if existing else 1
            if existing and (self._torn(existing[-1]) or existing[-1].stat().st_size >= segment_bytes):
                number += 1  # never append after a torn line: the reader could no longer tell it was the last
            self._open(number)
        except OSError as exc:
            self._writer.release()
            raise TraceStoreError(f"{self.dir}: cannot open a segment to write ({exc.strerror})") from None

    @staticmethod
    def _torn(path: Path) -> bool:
        size = path.stat().st_size
        if size == 0:
            return False
        with open(path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) != b"\n"

    def _open(self, number: int) -> None:
        """Open segment `number` for appending, unbuffered: a write that fails leaves nothing in a buffer that a
        later flush would add after the undo."""
        self.number = number
        self.path = self.dir / _segment_name(number)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _next_segment(self) -> None:
        os.close(self._fd)
        self._fd = None
        newest = segments(self.dir)
        self._open(max([self.number] + [segment_number(p) for p in newest]) + 1)
        self._roll = False

    def _moved(self) -> bool:
        """The open segment is no longer the file of its name (moved away to clear the store): records appended
        to it would leave the store."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return True

    @property
    def total_bytes(self) -> int:
        return disk_bytes(self.dir)

    def ensure_room(self, *, feedback: bool = False) -> None:
        """StoreFull once the segments on disk hold `max_bytes`; a feedback record may go `feedback_bytes` past
        it, so the conversations already served can still be labeled when the store fills up."""
        used = self.total_bytes
        if used < self.max_bytes + (self.feedback_bytes if feedback else 0):
            return
        past = f" (and the {self.feedback_bytes} bytes past it kept for feedback)" if feedback else ""
        raise StoreFull(
            f"trace store {self.dir} is full ({used} bytes of max {self.max_bytes}{past}): "
            "snapshot it (`lopd serve snapshot`), move its segments away, or raise serve.store_max_bytes"
        )

    def append(self, record: dict) -> None:
        """Write one record as one line, fsync'd. A write that fails (a full disk) is undone, the segment cut
        back to where the line began, and raises DiskFull; if even the cut fails, the next record starts a new
        segment, so the partial line stays a torn last line that readers skip."""
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            try:
                if self._fd is None:  # opening the next segment failed last time: try again
                    self._open(self.number)
                elif self._roll or self._moved() or (self._size and self._size + len(line) > self.segment_bytes):
                    self._next_segment()
            except OSError as exc:
                raise self._disk_full(exc) from exc
            start = self._size
            try:
                _write_all(self._fd, line)
                os.fsync(self._fd)  # on disk before the request is answered
            except OSError as exc:
                self._undo(start)
                raise self._disk_full(exc) from exc
            self._size += len(line)

    def _undo(self, start: int) -> None:
        try:
            os.ftruncate(self._fd, start)
            os.fsync(self._fd)
        except OSError:
            self._roll = True
        self._size = start

    def _disk_full(self, exc: OSError) -> DiskFull:
        why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else f"a write failed ({exc.strerror})"
        return DiskFull(
            exc.errno or errno.EIO,
            f"trace store {self.dir}: {why}; the record was not kept and nothing partial is left "
            "(free space, then retry)",
        )

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._writer.release()


def read_records(store_dir: str | Path) -> Iterator[dict]:
    """Every record in order. A torn last line of a segment (a write cut by a crash) is skipped with a warning;
    a bad line anywhere else raises TraceStoreError naming the file and line (`lopd serve store repair`
    quarantines it)."""
    for path in segments(store_dir):
        *complete, tail = path.read_bytes().split(b"\n")  # a whole file ends with a newline: an empty tail
        for number, raw in enumerate(complete, start=1):
            if not raw.strip():
                continue
            record, why = parse_record(raw)
            if record is None:
                raise TraceStoreError(f"{path}:{number}: {why}; {REPAIR_HINT.replace('DIR', str(store_dir))}")
            yield record
        if tail:  # its request was never answered: the line's fsync had not returned
            warnings.warn(
                f"{path}: skipped a torn last record (line {len(complete) + 1}, {len(tail)} bytes): "
                "a write cut by a crash",
                stacklevel=2,
            )


def _assemble(records: Iterator[dict]) -> list[dict]:
    """One row per trajectory from the store's records in order: its turns concatenated, its latest feedback."""
    rows: dict[str, dict] = {}
    for rec in records:
        if rec["kind"] == "turn":
            _add_turn(rows, rec)
        elif rec["kind"] == "feedback":
            _add_feedback(rows, rec)
        else:
            raise TraceStoreError(f"unknown record kind {rec['kind']!r}")
    for row in rows.values():
        row["messages"] = json.dumps(row["messages"])
        if row.pop("judged_turns") < row["num_turns"]:  # a turn came after its label: nobody judged it
            row.update(labeled=False, reward=math.nan, success=False, checks="null")
    return list(rows.values())


def _new_row(rec: dict) -> dict:
    """A trajectory's row as its turn 0 starts it: unlabeled, nothing yet appended."""
    return {
        "trajectory_id": rec["trajectory_id"],
        "session": rec["session"],
        "parent": rec.get("parent") or "",
        "origin": rec["origin"],
        "model_version": rec["model_version"],
        "tokenizer": str(rec.get("tokenizer") or ""),
        "tools": json.dumps(rec.get("tools") or []),
        "token_ids": [],
        "action_mask": [],
        "sample_logprobs": [],
        "prompt_length": int(rec["prompt_length"]),
        "num_turns": 0,
        "finish_reason": "",
        "labeled": False,
        "reward": math.nan,
        "success": False,
        "checks": "null",
        "messages": [],
        "started": float(rec["time"]),
        "ended": float(rec["time"]),
        "judged_turns": 0,
    }


def _add_turn(rows: dict[str, dict], rec: dict) -> None:
    """Append a turn record to its trajectory's row; turns must come in order from 0."""
    tid = rec["trajectory_id"]
    row = rows.get(tid)
    if row is None:
        if rec["turn"] != 0:
            raise TraceStoreError(f"trajectory {tid}: turn {rec['turn']} without its turn 0; {REPAIR_HINT}")
        row = rows[tid] = _new_row(rec)
    elif rec["turn"] != row["num_turns"]:
        raise TraceStoreError(
            f"trajectory {tid}: turn {rec['turn']} follows turn {row['num_turns'] - 1}; {REPAIR_HINT}"
        )
    row["token_ids"] += rec["token_ids"]
    row["action_mask"] += rec["action_mask"]
    row["sample_logprobs"] += [float(v) for v in rec["sample_logprobs"]]
    row["messages"] += rec["messages"]
    row["num_turns"] += 1
    row["finish_reason"] = rec["finish_reason"]
    row["ended"] = float(rec["time"])


def _add_feedback(rows: dict[str, dict], rec: dict) -> None:
    """Label a trajectory's row with a feedback record (the latest wins)."""
    row = rows.get(rec["trajectory_id"])
    if row is None:  # its turns are in segments moved away (after a snapshot): nothing to label here
        warnings.warn(
            f"feedback for trajectory {rec['trajectory_id']} whose turns are not in this store: skipped", stacklevel=3
        )
        return
    row.update(
        labeled=True,
        reward=float(rec["reward"]),
        success=bool(rec["success"]),
        checks=json.dumps(rec.get("checks")),
        # the turns it judged: recorded with it, else (an older record) the turns written before it
        judged_turns=int(rec.get("turns", row["num_turns"])),
    )


def read_traces(store_dir: str | Path) -> pd.DataFrame:
    """The trace table of a store: one validated row per trajectory (schema.TRACE_SCHEMA); a store with no
    traffic yet is an empty table, a path that is no folder is FileNotFoundError (a mistyped --store or lopd.traces)."""
    if not Path(store_dir).is_dir():
        raise FileNotFoundError(f"no trace store at {store_dir} (a folder of traces-*.jsonl that `lopd serve` writes)")
    frame = pd.DataFrame(_assemble(read_records(store_dir)), columns=list(TRACE_SCHEMA.columns))
    for name, column in TRACE_SCHEMA.columns.items():  # an empty table's columns are objects, not strings
        if isinstance(column.dtype.type, pd.StringDtype):
            frame[name] = frame[name].astype(column.dtype.type)
    frame["reward"] = frame["reward"].astype(float)
    for col in ("prompt_length", "num_turns"):
        frame[col] = frame[col].astype(int)
    for col in ("started", "ended"):
        frame[col] = frame[col].astype(float)
    frame["labeled"] = frame["labeled"].astype(bool)
    frame["success"] = frame["success"].astype(bool)
    return validate_traces(frame)


def snapshot(store_dir: str | Path, out: str | Path) -> Path:
    """Write the store's trace table to `out` as parquet under the project's output rules (outputs.atomic_write:
    a crash leaves no half file, a folder or device is refused in one line, no temporary is left behind)."""
    file_target(out)  # a folder or device named as --out is refused before the store is read
    frame = read_traces(store_dir)
    with atomic_write(out) as fh:
        frame.to_parquet(fh, index=False)
    return Path(out)


def read_snapshot(path: str | Path) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    if "tokenizer" not in frame.columns:  # a snapshot from before traces kept their tokenizer's fingerprint
        frame.insert(frame.columns.get_loc("model_version") + 1, "tokenizer", pd.Series([""] * len(frame), dtype=str))
    for col in ("token_ids", "action_mask", "sample_logprobs"):
        frame[col] = frame[col].map(list)
    return validate_traces(frame)

"""The trace store: append-only JSON lines in numbered segments, one fsync'd line per record.

Why this shape: a served conversation is worth keeping only if it survives the server. Each record is one line,
written, flushed and fsync'd before the request that produced it is answered, so a `kill -9` loses at most the
requests in flight; a line torn by the kill is the last of its segment, and reading skips it with a warning.
A reopened store never appends after a torn line: it starts the next segment.

Records (JSON objects, `kind` first):
  * `turn`     — one served turn of a trajectory: the segment of ids it added (forced ids of the request's new
                 messages, then the sampled ids) with their action mask and sampling log-probs, the model version,
                 the messages it added; a trajectory's turn 0 also names its session, origin, parent and tools.
  * `feedback` — a reward in [0, 1], success and optional check results for one trajectory.
`read_traces` assembles the turns of each trajectory, in order, into one row of the trace table (schema.py).

Bound (stated, never a silent drop): a segment is closed at `segment_bytes` and the next one opened; once the
store holds `max_bytes`, `ensure_room` raises StoreFull and the server refuses new work with 503 until the
store is snapshot and cleared (or the bound raised). The check runs before a request starts, so the records of
requests already in flight may carry it past the bound by those records.

Snapshot: `snapshot(store_dir, out)` writes the validated trace table as one parquet file (atomically), the file
to `dvc add` or to name as a stage's out (`lopd serve snapshot --out FILE`, docs/serving.md).
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from lopd_core.outputs import atomic_write, file_target
from lopd_core.traces.schema import TRACE_SCHEMA, validate_traces

SEGMENT_GLOB = "traces-*.jsonl"


class StoreFull(RuntimeError):
    """The store holds its stated maximum: nothing more is accepted until it is snapshot and cleared."""


class TraceStoreError(ValueError):
    """A record that cannot be read and is not a torn last line: the store was edited or corrupted."""


def _segment_name(number: int) -> str:
    return f"traces-{number:06d}.jsonl"


def segments(store_dir: str | Path) -> list[Path]:
    return sorted(Path(store_dir).glob(SEGMENT_GLOB))


class TraceStore:
    """Appends records to the newest segment; thread-safe (one lock around write + fsync)."""

    def __init__(self, store_dir: str | Path, *, segment_bytes: int, max_bytes: int):
        if segment_bytes <= 0 or max_bytes <= 0:
            raise ValueError("segment_bytes and max_bytes must be positive")
        self.dir = Path(store_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise TraceStoreError(f"{self.dir}: a trace store is a folder, and this is a file (name a folder)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        existing = segments(self.dir)
        self.total_bytes = sum(p.stat().st_size for p in existing)
        number = int(existing[-1].stem.split("-")[1]) if existing else 1
        if existing and (self._torn(existing[-1]) or existing[-1].stat().st_size >= segment_bytes):
            number += 1  # never append after a torn line: the reader could no longer tell it was the last
        self._open(number)

    @staticmethod
    def _torn(path: Path) -> bool:
        size = path.stat().st_size
        if size == 0:
            return False
        with open(path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) != b"\n"

    def _open(self, number: int) -> None:
        self.number = number
        self.path = self.dir / _segment_name(number)
        self._file = open(self.path, "ab")  # noqa: SIM115  kept open for the store's life, closed in close()
        self._size = self._file.tell()

    def ensure_room(self) -> None:
        if self.total_bytes >= self.max_bytes:
            raise StoreFull(
                f"trace store {self.dir} is full ({self.total_bytes} bytes of max {self.max_bytes}): "
                "snapshot it (`lopd serve snapshot`), move its segments away, or raise "
                "serve.store_max_bytes"
            )

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            if self._size and self._size + len(line) > self.segment_bytes:
                self._file.close()
                self._open(self.number + 1)
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the request is answered
            self._size += len(line)
            self.total_bytes += len(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(store_dir: str | Path) -> Iterator[dict]:
    """Every record in order. A torn last line of a segment (a write cut by a crash) is skipped with a warning;
    an unreadable line anywhere else raises TraceStoreError naming the file and line."""
    for path in segments(store_dir):
        *complete, tail = path.read_bytes().split(b"\n")  # a whole file ends with a newline: an empty tail
        for number, raw in enumerate(complete, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as exc:
                raise TraceStoreError(f"{path}:{number}: unreadable record ({exc})") from None
            if not isinstance(record, dict) or "kind" not in record:
                raise TraceStoreError(f"{path}:{number}: not a trace record")
            yield record
        if tail:  # its request was never answered: the line's fsync had not returned
            warnings.warn(
                f"{path}: skipped a torn last record (line {len(complete) + 1}, {len(tail)} bytes): "
                "a write cut by a crash",
                stacklevel=2,
            )


def _assemble(records: Iterator[dict]) -> list[dict]:
    rows: dict[str, dict] = {}
    for rec in records:
        if rec["kind"] == "turn":
            tid = rec["trajectory_id"]
            row = rows.get(tid)
            if row is None:
                if rec["turn"] != 0:
                    raise TraceStoreError(f"trajectory {tid}: turn {rec['turn']} without its turn 0")
                row = rows[tid] = {
                    "trajectory_id": tid,
                    "session": rec["session"],
                    "parent": rec.get("parent") or "",
                    "origin": rec["origin"],
                    "model_version": rec["model_version"],
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
                }
            elif rec["turn"] != row["num_turns"]:
                raise TraceStoreError(f"trajectory {tid}: turn {rec['turn']} follows turn {row['num_turns'] - 1}")
            row["token_ids"] += rec["token_ids"]
            row["action_mask"] += rec["action_mask"]
            row["sample_logprobs"] += [float(v) for v in rec["sample_logprobs"]]
            row["messages"] += rec["messages"]
            row["num_turns"] += 1
            row["finish_reason"] = rec["finish_reason"]
            row["ended"] = float(rec["time"])
        elif rec["kind"] == "feedback":
            row = rows.get(rec["trajectory_id"])
            if row is None:  # its turns are in segments moved away (after a snapshot): nothing to label here
                warnings.warn(
                    f"feedback for trajectory {rec['trajectory_id']} whose turns are not in this store: skipped",
                    stacklevel=2,
                )
                continue
            row.update(
                labeled=True,
                reward=float(rec["reward"]),
                success=bool(rec["success"]),
                checks=json.dumps(rec.get("checks")),
            )  # the latest feedback wins
        else:
            raise TraceStoreError(f"unknown record kind {rec['kind']!r}")
    for row in rows.values():
        row["messages"] = json.dumps(row["messages"])
    return list(rows.values())


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
    for col in ("token_ids", "action_mask", "sample_logprobs"):
        frame[col] = frame[col].map(list)
    return validate_traces(frame)

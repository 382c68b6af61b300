"""The trace store: append-only JSON lines in numbered segments, every line fsync'd before its request is answered.

Why this shape: a served conversation is worth keeping only if it survives the server. Each record is one line,
written and fsync'd before the request that produced it is answered, so a `kill -9` loses at most the requests in
flight; a line torn by the kill is the last of its segment, and reading skips it with a warning. A reopened store
never appends after a torn line: it starts the next segment. Group commit: the records of concurrent requests
share one write and one fsync (`TraceStore.append`), each request still answered only after the fsync that covers
its record, so the guarantee is the same and one fsync's cost is paid once per group, not once per record.

Records (JSON objects, `kind` first):
  * `turn`     — one served turn of a trajectory: the segment of ids it added (forced ids of the request's new
                 messages, then the sampled ids) with their action mask and sampling log-probs, the model version,
                 the messages it added, the fingerprint of the tokenizer that made the ids (fingerprint.py); a
                 trajectory's turn 0 also names its session, origin, parent and tools.
                 A turn 0 of origin `rotated` carries its parent's turns whole (`carried_turns` of them, their ids,
                 mask, log-probs and messages) before its own: the turn that followed a rotation (below).
  * `feedback` — a reward in [0, 1], success and optional check results for one trajectory, and the number of
                 its turns it judged (`turns`): a turn recorded after them clears the label on read, since nobody
                 judged it (the server starts a new trajectory after a label; this covers a turn in flight).
`read_traces` assembles the turns of each trajectory, in order, into one row of the trace table (schema.py).

Bound (stated, never a silent drop): a segment is closed at `segment_bytes` and the next one opened; once the
segments on disk hold `max_bytes`, `ensure_room` raises StoreFull and the server refuses new work with 503 until
the store is rotated (below), snapshot and cleared, or the bound raised. The bound is counted from disk, not from
this process's writes, so moving segments away (a rotation does) frees room at once; a feedback record may go
`feedback_bytes` past it, so the conversations already answered can still be labeled. The check runs before a
request starts, so the records of requests already in flight may carry it past the bound by those records.

Faults: one writer per store (lock.py: a second server on the same folder is refused). A write that fails (a
full disk) is cut back to where its line began and raises DiskFull (the server answers 507): no partial line is
ever followed by another record. A bad line found later (an edited store) is refused by readers with its file
and line; `lopd serve store repair` (repair.py) quarantines it.

Rotation (`TraceStore.rotate`, `lopd serve store rotate`): the server itself closes the live segments and moves
them into `DIR/archive/rotation-NNNN-<stamp>/`, a store of its own, and goes on in a new segment; the store's epoch
(`DIR/.rotation`) counts rotations. A later turn names the epoch its trajectory started in, and is refused
(Rotated) once that epoch is past: the server writes it as a turn 0 carrying the whole history instead, so neither
store ever holds a turn without its turn 0. Segments move one by one, so the mark says "moving" meanwhile and a
reader that overlapped a rotation reads again; the archive appears whole, by one rename of the folder it was
filled in; a rotation a crash cut short is finished when the store is next opened.

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
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lopd_core.outputs import atomic_write, file_target
from lopd_core.traces.errors import DiskFull, Rotated, StoreFull, TraceStoreError
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


ARCHIVE_DIR = "archive"  # DIR/archive/rotation-NNNN-<stamp>/: the segments a rotation took out of the live store
ROTATION_MARK = ".rotation"  # DIR/.rotation: the store's epoch, and whether a rotation is moving segments
GROUP_MAX_RECORDS = 512  # records one fsync covers at most (a bound on how long one leader writes for the others)
READ_TRIES = 100  # a reader that meets a rotation waits for it, READ_WAIT_S each time, this many times at most
READ_WAIT_S = 0.02


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotation_state(store_dir: str | Path) -> dict:
    """The store's rotation mark: {"epoch": rotations done, "state": "done" | "moving", ...}; a store never rotated
    has none (epoch 0)."""
    try:
        return json.loads((Path(store_dir) / ROTATION_MARK).read_text())
    except FileNotFoundError:
        return {"epoch": 0, "state": "done"}


def _write_mark(store_dir: Path, mark: dict) -> None:
    """Replace the rotation mark atomically and durably (a reader sees the old mark or the new, never half)."""
    tmp = store_dir / (ROTATION_MARK + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(mark))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, store_dir / ROTATION_MARK)
    _fsync_dir(store_dir)


@dataclass
class Rotation:
    """What `TraceStore.rotate` did: the archive folder (None: the live store held no record, nothing moved), the
    segments it holds, their bytes, and the store's epoch after it."""

    archive: Path | None
    segments: list[str]
    bytes: int
    epoch: int


@dataclass
class _Pending:
    """One record waiting for the fsync that covers it (group commit)."""

    line: bytes
    epoch: int | None  # the epoch its trajectory started in (a later turn), or None: written in any epoch
    done: bool = False
    error: BaseException | None = None
    written_in: int = -1  # the epoch it was written in


class TraceStore:
    """Appends records to the newest segment, many records per fsync (group commit), each `append` returning only
    once the fsync that covers its record has; the store's only writer while open (lock.py); thread-safe.

    Group commit (leader/follower): a thread that appends while no write is under way becomes the leader: it takes
    every record queued so far (up to GROUP_MAX_RECORDS), writes them as one `write` and one `fsync`, then wakes the
    others, whose records it covered; records queued meanwhile wait for the next leader. With `group_commit=False`
    each fsync covers one record (the readable path, and the benchmark's baseline: benchmarks/store_commit.py)."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        segment_bytes: int,
        max_bytes: int,
        feedback_bytes: int = 0,
        group_commit: bool = True,
    ):
        if segment_bytes <= 0 or max_bytes <= 0 or feedback_bytes < 0:
            raise ValueError("segment_bytes and max_bytes must be positive, feedback_bytes not negative")
        self.dir = Path(store_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise TraceStoreError(f"{self.dir}: a trace store is a folder, and this is a file (name a folder)")
        self.segment_bytes, self.max_bytes, self.feedback_bytes = segment_bytes, max_bytes, feedback_bytes
        self.group_max = GROUP_MAX_RECORDS if group_commit else 1
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._busy = False  # a leader is writing (or a rotation moving segments): the others wait
        self.fsyncs = self.records = 0  # how many fsyncs covered how many records (the benchmark's count)
        self._fd: int | None = None
        self._roll = False  # a failed write could not be undone: the next record starts a new segment
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = WriterLock(self.dir, purpose="a trace store writer")
        except PermissionError as exc:
            raise TraceStoreError(f"{self.dir}: the trace store is not writable ({exc.strerror})") from None
        try:
            self.epoch = self._finish_rotation()  # one a crash interrupted is finished before anything is written
            existing = segments(self.dir)
            number = segment_number(existing[-1]) if existing else rotation_state(self.dir).get("next_segment", 1)
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
            "rotate it while serving (`lopd serve store rotate`), snapshot it (`lopd serve snapshot`), "
            "or raise serve.store_max_bytes"
        )

    def append(self, record: dict, *, epoch: int | None = None) -> int:
        """Write one record as one line and return once an fsync covers it; returns the epoch it was written in.
        `epoch`: the epoch the record's trajectory started in (a later turn's): Rotated, nothing written, if the
        store was rotated since (its earlier turns are in the archive). A write that fails (a full disk) is undone,
        the segment cut back to where the line began, and raises DiskFull; if even the cut fails, the next record
        starts a new segment, so the partial line stays a torn last line that readers skip."""
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        entry = _Pending(line, epoch)
        with self._cv:
            self._queue.append(entry)
            while not entry.done:
                if self._busy:
                    self._cv.wait()
                    continue
                batch = self._take()
                self._busy = True
                self._cv.release()
                try:
                    self._commit(batch)
                finally:
                    self._cv.acquire()
                    self._busy = False
                    self._cv.notify_all()
        if entry.error is not None:
            raise entry.error
        return entry.written_in

    def _take(self) -> list[_Pending]:
        """The next group, under the condition's lock: records of a trajectory that started before the latest
        rotation are answered Rotated here, so a rotation (which holds the store busy) falls between groups."""
        batch: list[_Pending] = []
        while self._queue and len(batch) < self.group_max:
            entry = self._queue.pop(0)
            if entry.epoch is not None and entry.epoch != self.epoch:
                entry.error = Rotated(f"trace store {self.dir} was rotated (epoch {entry.epoch} -> {self.epoch})")
                entry.done = True
            else:
                batch.append(entry)
        return batch

    def _commit(self, batch: list[_Pending]) -> None:
        """Write `batch` as few groups as the segment bound allows, one fsync each; a group that fails is undone
        and its records written one by one, so a record that fits on the disk is kept as it would be alone."""
        i = 0
        try:
            while i < len(batch):
                group = self._group(batch, i)
                if not self._write(group) and len(group) > 1:
                    for entry in group:
                        self._write([entry])
                i += len(group)
        except BaseException as exc:  # never leave a follower waiting for ever
            for entry in batch:
                if not entry.done:
                    entry.error, entry.done = exc, True
            raise

    def _group(self, batch: list[_Pending], i: int) -> list[_Pending]:
        """The records from `batch[i]` on that go into the open segment (the first always does)."""
        size = self._size + len(batch[i].line)
        n = i + 1
        while n < len(batch) and size + len(batch[n].line) <= self.segment_bytes:
            size += len(batch[n].line)
            n += 1
        return batch[i:n]

    def _write(self, group: list[_Pending]) -> bool:
        """One write and one fsync for `group`; False (each record's error set when alone) if it failed."""
        try:
            if self._fd is None:  # opening the next segment failed last time: try again
                self._open(self.number)
            elif self._roll or self._moved() or (self._size and self._size + len(group[0].line) > self.segment_bytes):
                self._next_segment()
        except OSError as exc:
            return self._failed(group, exc)
        start = self._size
        data = b"".join(entry.line for entry in group)
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)  # on disk before any of these requests is answered
        except OSError as exc:
            self._undo(start)
            return self._failed(group, exc)
        self._size += len(data)
        self.fsyncs, self.records = self.fsyncs + 1, self.records + len(group)
        for entry in group:
            entry.written_in, entry.done = self.epoch, True
        return True

    def _failed(self, group: list[_Pending], exc: OSError) -> bool:
        if len(group) == 1:
            group[0].error, group[0].done = self._disk_full(exc), True
        return False

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

    def rotate(self) -> Rotation:
        """Close the live segments and move them, whole, into a new folder `DIR/archive/rotation-NNNN-<stamp>/`
        (a store of its own that readers read as any), then go on in a new segment. Appends wait meanwhile; a
        later turn of a trajectory that started before is answered Rotated from then on (`append`)."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            self._busy = True
        try:
            return self._rotate()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _rotate(self) -> Rotation:
        moving = segments(self.dir)
        held = sum(p.stat().st_size for p in moving)
        if held == 0:  # no record since the last rotation: every trajectory of the live store is whole there
            return Rotation(None, [], 0, self.epoch)
        name = f"rotation-{self.epoch + 1:04d}-{time.strftime('%Y%m%d-%H%M%S')}"
        next_segment = max(self.number, segment_number(moving[-1])) + 1
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.number = next_segment  # if what follows fails, the next append opens a new segment, never a moved one
        mark = {"epoch": self.epoch, "state": "moving", "archive": name, "segments": [p.name for p in moving]}
        _write_mark(self.dir, {**mark, "next_segment": next_segment})
        self.epoch = self._finish_rotation()
        self._open(next_segment)
        return Rotation(self.dir / ARCHIVE_DIR / name, [p.name for p in moving], held, self.epoch)

    def _finish_rotation(self) -> int:
        """Carry out the rotation the mark says is moving (this one, or one a crash cut short: moving is idempotent),
        and return the store's epoch. The archive appears whole, by one rename of the folder it was filled in."""
        mark = rotation_state(self.dir)
        if mark.get("state") != "moving":
            return int(mark.get("epoch", 0))
        archive = self.dir / ARCHIVE_DIR / mark["archive"]
        staging = archive.with_name(f".{mark['archive']}.partial")
        if not archive.exists():
            staging.mkdir(parents=True, exist_ok=True)
            for name in mark["segments"]:
                with contextlib.suppress(FileNotFoundError):  # moved before the crash
                    os.rename(self.dir / name, staging / name)
            _fsync_dir(staging)
            os.rename(staging, archive)
            _fsync_dir(archive.parent)
        epoch = int(mark["epoch"]) + 1
        _write_mark(self.dir, {"epoch": epoch, "state": "done", "archive": mark["archive"], **_next(mark)})
        return epoch

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._writer.release()


def _next(mark: dict) -> dict:
    return {"next_segment": mark["next_segment"]} if "next_segment" in mark else {}


def _segment_bytes(store_dir: str | Path) -> list[tuple[Path, bytes]]:
    """Every segment's bytes as of one moment: a read that a rotation overlapped (the mark moving, or its epoch
    changed between before and after, or a segment gone meanwhile) is read again, so a reader never sees part of
    the segments a rotation moved: every trajectory it sees has its turn 0."""
    for _ in range(READ_TRIES):
        before = rotation_state(store_dir)
        if before.get("state") == "done":
            try:
                data = [(path, path.read_bytes()) for path in segments(store_dir)]
            except FileNotFoundError:
                data = None
            if data is not None and rotation_state(store_dir) == before:
                return data
        time.sleep(READ_WAIT_S)
    raise TraceStoreError(
        f"{store_dir}: a rotation is moving its segments (or one was cut short: the server finishes it when it next "
        "opens the store); read it again once it is done"
    )


def read_records(store_dir: str | Path) -> Iterator[dict]:
    """Every record in order. A torn last line of a segment (a write cut by a crash) is skipped with a warning;
    a bad line anywhere else raises TraceStoreError naming the file and line (`lopd serve store repair`
    quarantines it)."""
    for path, data in _segment_bytes(store_dir):
        *complete, tail = data.split(b"\n")  # a whole file ends with a newline: an empty tail
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
        "started": float(rec.get("started", rec["time"])),  # a carried trajectory started in its parent
        "ended": float(rec["time"]),
        "judged_turns": 0,
    }


def _add_turn(rows: dict[str, dict], rec: dict) -> None:
    """Append a turn record to its trajectory's row; turns must come in order from 0 (a turn 0 that carries
    `carried_turns` of its parent's counts as that many more)."""
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
    row["num_turns"] += 1 + int(rec.get("carried_turns", 0))
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

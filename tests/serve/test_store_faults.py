"""The store under faults: a write cut by a full disk leaves no partial line, one writer per store, the bound
counted from disk, feedback past the bound, and check/repair quarantining bad lines instead of every reader
refusing the store."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings

import pytest

from lopd_core.traces import DiskFull, StoreFull, StoreLocked, TraceStore, TraceStoreError, read_traces
from lopd_core.traces import store as store_module
from lopd_core.traces.repair import check_store, repair_store
from lopd_core.traces.store import segments
from tests.serve.test_store import turn


def feedback(tid: str) -> dict:
    return {"kind": "feedback", "session": "s", "trajectory_id": tid, "reward": 1.0, "success": True, "checks": None}


def open_store(path, **kw) -> TraceStore:
    return TraceStore(path, segment_bytes=kw.pop("segment_bytes", 10**6), max_bytes=kw.pop("max_bytes", 10**7), **kw)


class FullDisk:
    """os.write that, on a trace segment, writes the first half of what it is given, then fails as a full disk
    does (every other file, and every write once `free()` is called, is written as usual)."""

    def __init__(self, monkeypatch):
        self.real, self.full = os.write, True
        monkeypatch.setattr(store_module.os, "write", self)

    def free(self) -> None:
        self.full = False

    def __call__(self, fd, data):
        if not (self.full and "traces-" in os.readlink(f"/proc/self/fd/{fd}")):
            return self.real(fd, data)
        self.real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_cut_by_a_full_disk_leaves_no_partial_line(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.append(turn("a", 0))
    size = store.path.stat().st_size
    disk = FullDisk(monkeypatch)
    with pytest.raises(DiskFull, match="disk is full"):
        store.append(turn("b", 0))
    assert store.path.stat().st_size == size  # cut back to where the line began
    disk.free()
    store.append(feedback("a"))
    store.append(turn("b", 0))
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn line either
        traces = read_traces(tmp_path)
    assert sorted(traces["trajectory_id"]) == ["a", "b"] and traces.set_index("trajectory_id")["success"]["a"]


def test_when_the_cut_itself_fails_the_next_record_starts_a_new_segment(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.append(turn("a", 0))
    disk = FullDisk(monkeypatch)
    monkeypatch.setattr(store_module.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(DiskFull):
        store.append(turn("b", 0))
    disk.free()
    store.append(turn("c", 0))
    store.close()
    assert len(segments(tmp_path)) == 2  # the partial line stays the torn last line of the first
    with pytest.warns(UserWarning, match="torn last record"):
        assert sorted(read_traces(tmp_path)["trajectory_id"]) == ["a", "c"]


def test_one_writer_per_store(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(StoreLocked, match="one writer per store"):
        open_store(tmp_path)
    store.close()
    open_store(tmp_path).close()  # released with the store


def test_the_bound_is_counted_from_disk_and_moving_segments_away_frees_it(tmp_path):
    store = open_store(tmp_path / "s", segment_bytes=10**6, max_bytes=1000)
    store.append(turn("a", 0))
    store.ensure_room()
    (tmp_path / "s" / "traces-000000.jsonl").write_bytes(b"\n" * 2000)  # bytes this process did not write
    with pytest.raises(StoreFull):
        store.ensure_room()
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in segments(tmp_path / "s"):
        shutil.move(path, moved / path.name)
    store.ensure_room()  # the documented remedy works while the server runs
    store.append(turn("b", 0))
    store.close()
    assert list(read_traces(tmp_path / "s")["trajectory_id"]) == ["b"]  # not appended to the moved file
    assert list(read_traces(moved)["trajectory_id"]) == ["a"]


def test_feedback_may_pass_the_bound_by_its_reserve(tmp_path):
    store = open_store(tmp_path, max_bytes=100, feedback_bytes=2000)
    store.append(turn("a", 0))
    with pytest.raises(StoreFull):
        store.ensure_room()
    store.ensure_room(feedback=True)  # the conversation already answered can still be labeled
    store.append(feedback("a"))
    store.close()
    assert bool(read_traces(tmp_path)["labeled"][0])


def test_check_and_repair_quarantine_bad_lines_and_keep_every_good_record(tmp_path):
    store = open_store(tmp_path)
    store.append(turn("a", 0))
    store.append(feedback("a"))
    store.close()
    good = json.dumps(turn("b", 0), separators=(",", ":")).encode()
    with open(segments(tmp_path)[0], "ab") as f:  # what an older version left after a full disk
        f.write(b'{"kind":"turn","trajectory_id":"x","tu' + good + b"\n")
        f.write(b"not json at all\n")
        f.write((json.dumps(feedback("b")) + "\n").encode())
    with pytest.raises(TraceStoreError, match=r"traces-000001.jsonl:3: .*lopd serve store repair"):
        read_traces(tmp_path)
    problems = check_store(tmp_path)
    assert [(p.line, p.kept_bytes > 0) for p in problems] == [(3, True), (4, False)]
    with open_store(tmp_path), pytest.raises(StoreLocked):  # never beside a writer
        repair_store(tmp_path)
    repaired, report = repair_store(tmp_path)
    assert len(repaired) == 2 and json.loads(report.read_text())["problems"][1]["why"].startswith("unreadable")
    assert (tmp_path / "quarantine").is_dir() and b"not json" in next(
        (tmp_path / "quarantine").glob("*.bad")
    ).read_bytes()
    traces = read_traces(tmp_path).set_index("trajectory_id")
    assert sorted(traces.index) == ["a", "b"] and traces["success"].all()  # the salvaged record was kept
    assert check_store(tmp_path) == []


def test_a_read_only_store_is_one_line(tmp_path, monkeypatch):
    from lopd_core.traces import lock

    def refused(*args):  # what a folder the server may not write gives (root would write anyway)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(lock.os, "open", refused)
    with pytest.raises(TraceStoreError, match="not writable"):
        open_store(tmp_path)

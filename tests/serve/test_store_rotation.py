"""The store's group commit and rotation (issue #47 item 3), below the server: many records per fsync and none lost
to concurrent writers, a full disk under concurrent writers leaving nothing partial, a rotation that moves the
live segments into an archive whole while later turns of archived trajectories are refused (Rotated), a reader
that overlaps a rotation reading again, and a rotation a crash cut short finished when the store is next opened."""

from __future__ import annotations

import asyncio
import json
import threading
import warnings

import pytest

from lopd_core.model.chat import TrajectoryIds
from lopd_core.traces import DiskFull, TraceStore, TraceStoreError, read_traces
from lopd_core.traces import store as store_module
from lopd_core.traces.errors import Rotated
from lopd_core.traces.store import ROTATION_MARK, rotation_state, segments
from lopd_serve.sessions import Plan, Recorded, Session, keep_turn
from tests.serve.test_store import turn
from tests.serve.test_store_faults import FullDisk, open_store


def write_from_threads(store: TraceStore, writers: int, each: int) -> list[BaseException]:
    """`writers` threads appending `each` turn-0 records at once, through one barrier; the errors they met."""
    errors: list[BaseException] = []
    start = threading.Barrier(writers)

    def write(k: int) -> None:
        start.wait()
        for i in range(each):
            try:
                store.append(turn(f"w{k}-{i}", 0))
            except DiskFull as exc:
                errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("grouped", [True, False])
def test_concurrent_writers_lose_nothing_and_share_fsyncs_when_grouped(tmp_path, grouped):
    store = open_store(tmp_path, segment_bytes=4000, group_commit=grouped)  # small segments: groups span them
    assert write_from_threads(store, writers=8, each=25) == []
    store.close()
    assert store.records == 200
    # one fsync per record alone; grouped, fewer (8 threads queue behind one leader's fsync)
    assert store.fsyncs == 200 if not grouped else store.fsyncs < 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn line
        traces = read_traces(tmp_path)
    assert sorted(traces["trajectory_id"]) == sorted(f"w{k}-{i}" for k in range(8) for i in range(25))
    assert len(segments(tmp_path)) > 1 and all(p.stat().st_size <= 4000 for p in segments(tmp_path))


def test_a_full_disk_under_concurrent_writers_refuses_each_record_and_leaves_nothing_partial(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.append(turn("kept", 0))
    disk = FullDisk(monkeypatch)
    errors = write_from_threads(store, writers=4, each=5)
    assert len(errors) == 20 and all("disk is full" in str(e) for e in errors)
    disk.free()
    store.append(turn("after", 0))
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(read_traces(tmp_path)["trajectory_id"]) == ["after", "kept"]


def test_a_rotation_archives_whole_trajectories_and_refuses_a_later_turn_of_them(tmp_path):
    store = open_store(tmp_path / "s")
    assert store.append(turn("a", 0)) == 0 and store.append(turn("a", 1), epoch=0) == 0
    done = store.rotate()
    assert done.epoch == 1 and done.archive.parent == tmp_path / "s" / "archive" and done.segments
    assert store.total_bytes == 0  # the bound counts the live store only: room at once
    with pytest.raises(Rotated):  # its turn 0 is in the archive: this record would be an orphan
        store.append(turn("a", 2), epoch=0)
    carrier = turn("a2", 0, ids=(5, 6, 7) * 3, mask=(0, 1, 1) * 3, lps=(0.0, -0.5, -0.25) * 3)
    carrier.update(origin="rotated", parent="a", carried_turns=2, started=1.0)
    assert store.append(carrier) == 1
    store.append(turn("a2", 3), epoch=1)
    assert store.rotate().epoch == 2 and store.rotate().archive is None  # nothing since: nothing moved
    store.close()
    archive = read_traces(done.archive).set_index("trajectory_id")
    assert list(archive.index) == ["a"] and archive.loc["a", "num_turns"] == 2
    second = read_traces(next(p for p in (tmp_path / "s" / "archive").iterdir() if p != done.archive))
    row = second.set_index("trajectory_id").loc["a2"]
    assert row["num_turns"] == 4 and row["origin"] == "rotated" and row["parent"] == "a" and row["started"] == 1.0
    assert len(read_traces(tmp_path / "s")) == 0
    assert TraceStore(tmp_path / "s", segment_bytes=10**6, max_bytes=10**7).epoch == 2  # kept across a reopen


def test_a_reader_waits_out_a_rotation_and_a_cut_short_one_is_finished_on_open(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.append(turn("a", 0))
    store.append(turn("a", 1))
    store._next_segment()  # two segments, the trajectory across both
    store.append(turn("a", 2))
    store.close()
    first, second = segments(tmp_path)
    # what a crash halfway through a rotation leaves: the mark says moving, the first segment moved already
    mark = {"epoch": 0, "state": "moving", "archive": "rotation-0001-x", "segments": [first.name, second.name]}
    (tmp_path / ROTATION_MARK).write_text(json.dumps(mark))
    (tmp_path / "archive" / ".rotation-0001-x.partial").mkdir(parents=True)
    first.rename(tmp_path / "archive" / ".rotation-0001-x.partial" / first.name)
    monkeypatch.setattr(store_module, "READ_WAIT_S", 0.0)
    with pytest.raises(TraceStoreError, match="rotation is moving"):  # never the orphan turns of the second
        read_traces(tmp_path)
    reopened = open_store(tmp_path)  # finishes the move before it writes anything
    assert reopened.epoch == 1 and rotation_state(tmp_path)["state"] == "done"
    reopened.close()
    archived = read_traces(tmp_path / "archive" / "rotation-0001-x")
    assert archived["num_turns"].tolist() == [3] and len(read_traces(tmp_path)) == 0


def test_a_turn_rotated_away_while_it_was_decoded_is_written_as_a_turn_0_that_carries_it(tmp_path):
    store, recorded = open_store(tmp_path), Recorded(cap=8)
    session = Session(id="s", trajectory_id="t", num_turns=1, prompt_length=1, started=1.0)
    session.ids = TrajectoryIds([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25])
    store.append(turn("t", 0))
    recorded.add("t", "s", turns=1)
    segment = TrajectoryIds([8, 9], [0, 1], [0.0, -0.1])
    plan = Plan("t", 1, "extends", "", segment, [5, 6, 7, 8, 9], new_messages=2)

    def record(p: Plan) -> dict:
        if p.turn:  # the rotation lands between the plan and the write
            store.rotate()
        rec = turn(p.trajectory_id, p.turn, ids=p.segment.token_ids, mask=p.segment.action_mask)
        rec.update(sample_logprobs=p.segment.sample_logprobs, origin=p.origin, parent=p.parent)
        return {**rec, "carried_turns": p.carried} if p.carried else rec

    written = asyncio.run(keep_turn(store, recorded, session, plan, record, messages=3))
    store.close()
    assert written.turn == 0 and written.origin == "rotated" and written.parent == "t" and written.carried == 1
    assert written.segment.token_ids == [5, 6, 7, 8, 9] and written.segment.action_mask == [0, 1, 1, 0, 1]
    assert recorded.current("t") == written.trajectory_id and recorded.turns(written.trajectory_id) == 2
    live = read_traces(tmp_path).set_index("trajectory_id")
    assert list(live.index) == [written.trajectory_id] and live["num_turns"].iloc[0] == 2

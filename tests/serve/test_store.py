"""The trace store: records survive as whole lines, a torn last line is skipped with a warning, segments rotate
at their bound, a full store refuses, and a snapshot reads back through the schema."""

from __future__ import annotations

import pytest

from lopd_core.traces import StoreFull, TraceStore, TraceStoreError, read_records, read_traces, snapshot
from lopd_core.traces.store import read_snapshot, segments


def turn(tid: str, n: int, *, ids=(5, 6, 7), mask=(0, 1, 1), lps=(0.0, -0.5, -0.25)) -> dict:
    record = {
        "kind": "turn",
        "trajectory_id": tid,
        "turn": n,
        "session": "s",
        "origin": "new" if n == 0 else "extends",
        "parent": "",
        "model_version": "v1",
        "prompt_length": 1,
        "token_ids": list(ids),
        "action_mask": list(mask),
        "sample_logprobs": list(lps),
        "finish_reason": "stop",
        "messages": [{"role": "assistant", "content": "x"}],
        "time": 1.0 + n,
    }
    if n == 0:
        record["tools"] = []
    return record


def test_torn_last_line_is_skipped_and_the_next_write_opens_a_segment(tmp_path):
    store = TraceStore(tmp_path, segment_bytes=10**6, max_bytes=10**7)
    store.append(turn("a", 0))
    store.append(turn("a", 1))
    store.close()
    with open(segments(tmp_path)[0], "ab") as f:  # what a kill -9 in the middle of a write leaves
        f.write(b'{"kind": "turn", "trajectory_id": "b", "tu')
    with pytest.warns(UserWarning, match="torn last record"):
        traces = read_traces(tmp_path)
    assert list(traces["trajectory_id"]) == ["a"] and traces["num_turns"][0] == 2
    assert traces["token_ids"][0] == [5, 6, 7, 5, 6, 7]
    reopened = TraceStore(tmp_path, segment_bytes=10**6, max_bytes=10**7)
    reopened.append(turn("c", 0))
    assert len(segments(tmp_path)) == 2  # never appended after the torn line
    with pytest.warns(UserWarning):
        assert sorted(read_traces(tmp_path)["trajectory_id"]) == ["a", "c"]


def test_a_corrupt_line_inside_a_segment_is_an_error(tmp_path):
    (tmp_path / "traces-000001.jsonl").write_text('{"kind": "turn"\n' + "{}\n")
    with pytest.raises(TraceStoreError, match="traces-000001.jsonl:1"):
        list(read_records(tmp_path))


def test_rotation_and_the_bound(tmp_path):
    store = TraceStore(tmp_path, segment_bytes=600, max_bytes=2000)
    for i in range(20):
        try:
            store.ensure_room()
        except StoreFull as exc:
            assert "snapshot" in str(exc)
            break
        store.append(turn(f"t{i}", 0))
    else:
        pytest.fail("the store never said it was full")
    assert len(segments(tmp_path)) > 1
    assert len(read_traces(tmp_path)) == i  # every accepted record is there


def test_schema_catches_a_bad_record_and_snapshot_round_trips(tmp_path):
    store = TraceStore(tmp_path / "s", segment_bytes=10**6, max_bytes=10**7)
    store.append(turn("a", 0))
    store.append(
        {
            "kind": "feedback",
            "session": "s",
            "trajectory_id": "a",
            "reward": 1.0,
            "success": True,
            "checks": [True],
            "time": 3.0,
        }
    )
    out = snapshot(tmp_path / "s", tmp_path / "snap.parquet")
    back = read_snapshot(out)
    assert back["success"][0] and back["token_ids"][0] == [5, 6, 7]
    store.append(turn("bad", 0, mask=(0, 2, 1)))  # a mask that is not 0/1: found by its line, not the whole table
    with pytest.raises(TraceStoreError, match=r"traces-000001.jsonl:3: .*action mask"):
        read_traces(tmp_path / "s")


def test_snapshot_command_writes_traces_and_rollout_rows(tmp_path):
    from lopd_cli.main import main
    from lopd_core.rollout.table import read_trajectories

    store = TraceStore(tmp_path / "s", segment_bytes=10**6, max_bytes=10**7)
    for tid in ("a", "b"):
        store.append(turn(tid, 0))
    store.append(
        {
            "kind": "feedback",
            "session": "s",
            "trajectory_id": "b",
            "reward": 0.5,
            "success": False,
            "checks": None,
            "time": 3.0,
        }
    )
    store.close()
    assert main(["serve", "snapshot", "--store", str(tmp_path / "s"), "--out", str(tmp_path / "t.parquet")]) == 0
    assert len(read_snapshot(tmp_path / "t.parquet")) == 2
    assert (
        main(
            [
                "serve",
                "snapshot",
                "--store",
                str(tmp_path / "s"),
                "--out",
                str(tmp_path / "r.parquet"),
                "--as-trajectories",
            ]
        )
        == 0
    )
    rows = read_trajectories(tmp_path / "r.parquet")  # the rollout table's own reader
    assert list(rows["task_id"]) == ["b"] and rows["reward"][0] == 0.5 and not rows["success"][0]


def test_the_trace_library_stays_below_the_server():
    """lopd_core/traces is library: it must not load the web framework, the tracking client or the orchestrator."""
    import subprocess
    import sys

    code = (
        "import sys, lopd_core.traces; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'uvicorn', 'starlette', 'mlflow', "
        "'prefect', 'openai', 'lopd_serve', 'tasks', 'flows'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_snapshot_over_a_folder_is_refused_and_leaves_nothing(tmp_path):
    """`--out` naming someone's folder (or `..`) is one line and touches nothing: no temporary beside it."""
    from lopd_core.outputs import OutputPathError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(OutputPathError, match="folder"):
        snapshot(tmp_path / "s", mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and (mine / "notes.txt").read_text() == "precious"


def test_an_empty_store_is_an_empty_table_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    assert len(read_traces(tmp_path / "empty")) == 0
    with pytest.raises(FileNotFoundError, match="no trace store at"):
        read_traces(tmp_path / "typo")


def test_a_store_path_that_is_a_file_is_refused_and_kept(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("precious")
    with pytest.raises(TraceStoreError, match="is a file"):
        TraceStore(mine, segment_bytes=1 << 20, max_bytes=1 << 30)
    assert mine.read_text() == "precious"

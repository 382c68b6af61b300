"""The careless user's store is one line each, never a traceback: an empty store, one with no feedback, a file
that is no snapshot, a bad line, a stray file; `lopd cycle --source traces` refuses a store without a labeled trace
before any work."""

from __future__ import annotations

import pytest

from lopd_core.traces import TraceStore, read_traces
from tests.serve.test_store import turn


def unlabeled_store(folder):
    with TraceStore(folder, segment_bytes=10**6, max_bytes=10**7) as store:
        store.append(turn("a", 0))
    return folder


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", ["empty", "unlabeled"])
def test_cycle_refuses_a_store_without_a_labeled_trace_before_any_work(kind, tmp_path, monkeypatch, capsys):
    from flows import stage_flows
    from lopd_cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(stage_flows, "base_flow", lambda *a, **k: pytest.fail("a base was built"))
    store = tmp_path / "traces"
    store.mkdir()
    if kind == "unlabeled":
        unlabeled_store(store)
    assert main(["cycle", "--source", "traces", "--set", f"lopd.traces={store}"]) == 2
    assert "no labeled trace" in one_line(capsys)
    assert not (tmp_path / "data").exists()  # nothing was started


def test_a_file_that_is_no_snapshot_is_one_line(tmp_path, monkeypatch, capsys):
    from lopd_cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not parquet")
    assert main(["bank", "--source", "traces", "--set", "lopd.traces=notes.txt"]) == 2
    assert "is not a trace snapshot" in one_line(capsys)


def test_a_bad_line_is_one_line_that_names_the_repair(tmp_path, monkeypatch, capsys):
    from lopd_cli.main import main

    monkeypatch.chdir(tmp_path)
    unlabeled_store(tmp_path / "traces")
    with open(tmp_path / "traces" / "traces-000001.jsonl", "ab") as f:
        f.write(b"garbage\n")
    assert main(["bank", "--source", "traces", "--set", "lopd.traces=traces"]) == 2
    assert "lopd serve store repair" in one_line(capsys)


def test_stray_files_in_the_store_folder_are_not_segments(tmp_path):
    unlabeled_store(tmp_path)
    (tmp_path / "traces-notes.jsonl").write_text("my notes")
    (tmp_path / "README").write_text("hello")
    (tmp_path / "traces-000009.jsonl.bak").mkdir()
    assert list(read_traces(tmp_path)["trajectory_id"]) == ["a"]
    TraceStore(tmp_path, segment_bytes=10**6, max_bytes=10**7).close()  # the writer opens past them too

"""The served store under a full disk: requests that cannot be recorded get 507 (a stream, an error event), no
partial record is left, and once space is freed every conversation the clients were answered and labeled is
readable; a second server on the same store is refused in one line."""

from __future__ import annotations

import json
import warnings

import httpx

from lopd_core.traces import TraceStore, read_traces
from tests.serve.conftest import make_server
from tests.serve.test_store_faults import FullDisk


def chat(live, session: str, *, stream: bool = False) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"hello from {session}"}],
        "max_tokens": 3,
        "user": session,
        "stream": stream,
    }
    return httpx.post(live.url + "/chat/completions", json=body, timeout=60)


def label(live, session: str) -> httpx.Response:
    return httpx.post(live.url + "/feedback", json={"session": session, "reward": 1.0, "success": True}, timeout=30)


def test_disk_full_mid_load_then_freed_loses_no_labeled_conversation(tiny_checkpoints, tmp_path, monkeypatch):
    answered, labeled = set(), set()
    with make_server(tiny_checkpoints[0], tmp_path / "t") as live:
        for s in ("a", "b", "c"):
            assert chat(live, s).status_code == 200 and label(live, s).status_code == 200
            answered.add(s), labeled.add(s)
        assert chat(live, "e").status_code == 200  # answered, not labeled yet
        answered.add("e")

        disk = FullDisk(monkeypatch)  # the disk fills up
        refused = chat(live, "d")
        assert refused.status_code == 507 and refused.json()["error"]["code"] == "disk_full"
        assert "disk is full" in refused.json()["error"]["message"]
        assert label(live, "e").status_code == 507  # the label was not kept: the client may send it again
        events = [line for line in chat(live, "f", stream=True).text.splitlines() if line.startswith("data: {")]
        assert json.loads(events[-1][6:])["error"]["code"] == "disk_full"

        disk.free()  # space freed: the same requests again
        assert label(live, "e").status_code == 200
        labeled.add("e")
        for s in ("d", "f"):
            assert chat(live, s).status_code == 200 and label(live, s).status_code == 200
            answered.add(s), labeled.add(s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn or partial line anywhere
        traces = read_traces(tmp_path / "t")
    assert set(traces["session"]) == answered
    assert set(traces[traces["labeled"] & traces["success"]]["session"]) == labeled  # 0 lost

    with make_server(tiny_checkpoints[0], tmp_path / "t") as again:  # the stopped server let go of its lock
        assert chat(again, "g").status_code == 200


def test_a_second_server_on_the_same_store_is_refused_in_one_line(tiny_checkpoints, tmp_path, capsys):
    from lopd_cli.main import main

    with TraceStore(tmp_path / "t", segment_bytes=10**6, max_bytes=10**7):  # the first server's store
        code = main(["serve", "--model", str(tiny_checkpoints[0]), "--store", str(tmp_path / "t"), "--port", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and "one writer per store" in err and "pid" in err


def test_feedback_past_the_bound_and_the_check_command(tiny_checkpoints, tmp_path, capsys):
    from lopd_cli.main import main

    with make_server(tiny_checkpoints[0], tmp_path / "t", store_max_bytes=1) as live:
        assert chat(live, "a").status_code == 200
        assert chat(live, "b").status_code == 503  # the bound holds for new turns
        assert label(live, "a").status_code == 200  # but the answered one can still be labeled
    assert bool(read_traces(tmp_path / "t")["success"][0])
    assert main(["serve", "store", "check", str(tmp_path / "t")]) == 0
    assert "0 bad lines" in capsys.readouterr().out

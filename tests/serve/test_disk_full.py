"""The served store under a full disk: requests that cannot be recorded get 507 (a stream, an error event), no
partial record is left, and once space is freed every conversation the clients were answered and labeled is
readable — with a write that fails half way (injected) and on a real small filesystem (a tmpfs the test mounts,
skipped where mounting is not permitted); a second server on the same store is refused in one line."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
import warnings

import httpx
import pytest

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


@contextlib.contextmanager
def small_filesystem(folder, size_bytes: int):
    """A tmpfs of `size_bytes` mounted at `folder` for the test (skipped where mounting is not permitted)."""
    folder.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {exc}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)


def fill(folder):
    """Write a filler file until the filesystem is full; returns its path (unlink it to free the space)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    with pytest.raises(OSError) as full:
        (folder / "probe").write_bytes(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    return filler


def test_a_real_full_filesystem_then_freed_loses_no_labeled_conversation(tiny_checkpoints, tmp_path):
    """The same as above on a real filesystem (a small tmpfs) that fills up: the kernel's own short writes and
    ENOSPC (a write may still fit in the last page of the open segment, so requests go on until one is refused),
    a server restarted while the disk is still full, then space freed."""
    answered, labeled, refused = set(), set(), []
    with small_filesystem(tmp_path / "fs", 1 << 20) as fs:
        store = fs / "traces"
        with make_server(tiny_checkpoints[0], store) as live:
            for s in ("a", "b"):
                assert chat(live, s).status_code == 200 and label(live, s).status_code == 200
                answered.add(s), labeled.add(s)
            filler = fill(fs)
            for k in range(64):  # the load goes on until the disk refuses a record
                response = chat(live, f"c{k}")
                if response.status_code == 507:
                    assert response.json()["error"]["code"] == "disk_full"
                    refused.append(f"c{k}")
                    break
                assert response.status_code == 200, response.text
                answered.add(f"c{k}")
            assert refused, "the full filesystem never refused a record"
            events = [line for line in chat(live, "f", stream=True).text.splitlines() if line.startswith("data: {")]
            assert json.loads(events[-1][6:])["error"]["code"] == "disk_full"
            refused.append("f")
        with make_server(tiny_checkpoints[0], store) as again:  # restarted on the full disk: it starts, says so
            assert chat(again, refused[0]).status_code == 507
            # a small record may still fit where a turn did not: a label is kept (200) or refused (507), never lost
            for s in sorted(answered - labeled):
                code = label(again, s).status_code
                assert code in (200, 507)
                if code == 200:
                    labeled.add(s)
            filler.unlink()  # space freed: the refused requests again
            for s in sorted(answered - labeled):
                assert label(again, s).status_code == 200
                labeled.add(s)
            for s in refused:
                assert chat(again, s).status_code == 200 and label(again, s).status_code == 200
                answered.add(s), labeled.add(s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no torn or partial line anywhere
            traces = read_traces(store)
    assert set(traces["session"]) == answered
    assert set(traces[traces["labeled"] & traces["success"]]["session"]) == labeled  # 0 lost

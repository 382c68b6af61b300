"""What one careless or hostile client must not take from the others (issue #39, item 5): the session table, the
event loop, a connection held open, a keyless server reached through a rebound name. (An abandoned stream that
stops decoding: test_batch_faults.py.)"""

from __future__ import annotations

import socket
import threading
import time

import httpx

from tests.serve.conftest import make_server


def _ask(live, session, **kw):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    return httpx.post(live.url + "/chat/completions", json=body, headers={"x-session-id": session}, timeout=60, **kw)


def test_a_full_table_of_idle_sessions_makes_room_and_a_client_has_a_share(tiny_checkpoints, tmp_path):
    with make_server(tiny_checkpoints[0], tmp_path / "t", max_sessions=3, max_sessions_per_client=2) as live:
        sessions = live.app.state.sessions
        for name in ("a", "b", "c"):
            assert _ask(live, name).status_code == 200
        assert set(sessions.sessions) == {"b", "c"}  # one address holds two: its least recently used one closed
        for sid in ("x", "y"):  # other clients (their address as the table records it)
            sessions.get(sid, client="10.0.0.9").last_used -= 60
        assert _ask(live, "d").status_code == 200  # full of unlabeled idle sessions: the least recent one goes
        assert "d" in sessions.sessions and len(sessions.sessions) == 3 and "x" not in sessions.sessions


def test_rendering_runs_off_the_event_loop(live, monkeypatch):
    import lopd_serve.chat as chat

    threads = []
    real = chat.plan_turn
    monkeypatch.setattr(chat, "plan_turn", lambda *a: threads.append(threading.current_thread()) or real(*a))
    huge = "word " * 150_000  # refused once tokenized: far past serve.max_context
    body = {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}
    assert httpx.post(live.url + "/chat/completions", json=body, timeout=120).status_code in (400, 413)
    assert _ask(live, "s").status_code == 200
    assert threads and all(t is not threading.main_thread() and t.name != live.thread.name for t in threads)


def test_a_slow_body_is_timed_out(tiny_checkpoints, tmp_path):
    with make_server(tiny_checkpoints[0], tmp_path / "t", body_timeout_s=1.0) as live:
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 200\r\n\r\n{"messages"'
            )
            started = time.monotonic()
            answer = conn.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 8


def test_a_keyless_server_answers_only_loopback_hosts(live, tiny_checkpoints, tmp_path):
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.:1"):
        refused = httpx.get(live.root + "/health", headers={"host": host})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host", host
    for host in ("localhost", f"localhost:{live.port}", "127.0.0.1", "[::1]:8000"):
        assert httpx.get(live.root + "/health", headers={"host": host}).status_code == 200, host
    with make_server(tiny_checkpoints[0], tmp_path / "t", allowed_hosts=["box.lan"]) as named:
        assert httpx.get(named.root + "/health", headers={"host": "box.lan:8000"}).status_code == 200

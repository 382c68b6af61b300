"""End to end: the demo client plays toolworld through the endpoint; a hot swap under load fails nothing; a
server killed with SIGKILL mid-load leaves a readable store with every completed session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from lopd_core.envs import make_tasks
from lopd_core.traces import read_traces, traces_as_trajectories
from tests._servers import free_port, offline_env
from tests.serve.conftest import make_server

ROOT = Path(__file__).resolve().parents[2]


def test_client_plays_toolworld_and_posts_feedback(live):
    from lopd_serve.client import run_client

    tasks = make_tasks("toolworld", "test_id", 4, 0)
    summary = run_client(live.url, tasks, concurrency=4, max_tokens=24, seed=0)
    assert summary["failed"] == 0, summary["errors"]
    traces = read_traces(live.app.state.store.dir)
    assert len(traces) == 4 and traces["labeled"].all()  # one trajectory per session, each labeled
    by_session = {e["session"]: e for e in summary["episodes"]}
    for _, row in traces.iterrows():
        assert row["reward"] == by_session[row["session"]]["reward"]
        assert row["num_turns"] == by_session[row["session"]]["turns"]
        assert json.loads(row["tools"])  # the environment's tool schemas, as the request declared them
    assert len(traces_as_trajectories(traces)) == 4


def _converse(url: str, session: str, turns: int, failures: list, versions: list) -> None:
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "tools: lookup(key)"}, {"role": "user", "content": "find " + session}]
    try:
        for t in range(turns):
            r = c.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, seed=t, extra_headers={"X-Session-Id": session}
            )
            versions.append(r.model_extra["lopd"]["model_version"])
            messages += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "content": f"observation {t}"},
            ]
    except Exception as exc:  # noqa: BLE001  counted: the test asserts there are none
        failures.append(repr(exc))


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_hot_swap_during_requests_fails_none(tiny_checkpoints, tmp_path, engine):
    with make_server(tiny_checkpoints[0], tmp_path / "traces", engine=engine) as live:
        _hot_swap_under_load(live, tiny_checkpoints)


def _hot_swap_under_load(live, tiny_checkpoints) -> None:
    failures, versions = [], []
    threads = [threading.Thread(target=_converse, args=(live.url, f"s{i}", 30, failures, versions)) for i in range(4)]
    for t in threads:
        t.start()
    while len(versions) < 4 and not failures:  # the old model is serving the conversations
        time.sleep(0.01)
    old = versions[0]
    swapped = httpx.post(live.root + "/admin/reload", json={"model": str(tiny_checkpoints[1])}, timeout=120)
    for t in threads:
        t.join(timeout=300)
    assert swapped.status_code == 200 and swapped.json()["changed"]
    assert failures == []
    new = swapped.json()["model_version"]
    assert {old, new} <= set(versions) and old != new  # both served: the swap came between requests
    assert httpx.get(live.root + "/health").json()["model_version"] == new
    traces = read_traces(live.app.state.store.dir)
    assert set(traces["model_version"]) == {old, new}
    # a conversation that crossed the swap goes on in a new trajectory naming the old one
    crossed = traces[traces["origin"] == "model_changed"]
    assert len(crossed) >= 1 and (crossed["model_version"] == new).all() and (crossed["parent"] != "").all()


def _wait_for_a_load_turn(store, timeout_s: float = 120.0) -> None:
    """Until a turn of a load session is in the store's segments (bounded), so that the kill comes mid-load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(b'"load' in f.read_bytes() for f in store.rglob("*") if f.is_file()):
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_kill_9_mid_load_leaves_a_readable_store(tiny_checkpoints, tmp_path):
    port, store = free_port(), tmp_path / "traces"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lopd_cli.main",
            "serve",
            "--model",
            str(tiny_checkpoints[0]),
            "--port",
            str(port),
            "--store",
            str(store),
            "--poll-s",
            "0",
        ],
        cwd=ROOT,
        env=offline_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300  # two interpreters import torch: the server's and its engine's
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        done_failures, done_versions = [], []
        for i in range(3):  # completed sessions, answered before the kill
            _converse(url, f"done{i}", 2, done_failures, done_versions)
        assert done_failures == []
        load = [threading.Thread(target=_converse, args=(url, f"load{i}", 50, [], [])) for i in range(6)]
        for t in load:
            t.start()
        _wait_for_a_load_turn(store)  # a busy machine may answer nothing within a fixed second
        os.killpg(server.pid, signal.SIGKILL)
        for t in load:
            t.join(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line is allowed, and skipped with a warning
        traces = read_traces(store)
    done = traces[traces["session"].str.startswith("done")]
    assert sorted(done["session"]) == ["done0", "done1", "done2"] and (done["num_turns"] == 2).all()
    assert (traces["session"].str.startswith("load")).any()  # the kill came mid-load

"""The engine process under faults (issue #47, the slow test of items 1 and 2): 16 streaming clients while the
served model is hot-reloaded, an exception is injected into the engine's inbox and worker loops, the engine child
is killed, and its pipe is filled (the child stopped with SIGSTOP: alive, reading nothing). Measured: every
request answered or refused (429/503, or an error event in its stream) within its deadline — none hung; /health
answered within 1 s throughout; every stream that finished is in the store, every line of which parses (nothing
lost, nothing torn). The report loop's guard is tested alone (test_engine_guards.py): nothing outside the child
can make its counters fail."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.serve.conftest import make_server

DEADLINE_S = 20.0  # serve.request_timeout_s here
SLACK_S = 10.0  # a request answered later than its deadline plus this is counted as hung


class Load:
    """`clients` threads streaming one-turn chats until stopped, and a prober timing /health."""

    def __init__(self, live, clients: int):
        self.live, self.stop = live, threading.Event()
        self.outcomes: list[tuple[str, float]] = []  # (answered | refused | hung | broken, seconds)
        self.finished: list[str] = []  # trajectory ids of streams that ended with a finish reason and [DONE]
        self.health_s: list[float] = []
        self.phase, self.health_by_phase = "load", {}  # the slowest /health answer in each phase
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        self.threads.append(threading.Thread(target=self._probe, daemon=True))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=DEADLINE_S + SLACK_S + 5)

    def _client(self, k: int) -> None:
        for n in range(10_000):
            if self.stop.is_set():
                return
            body = {"messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 24, "stream": True}
            started = time.monotonic()
            outcome = self._one(body, {"x-session-id": f"c{k}-{n}"})
            self.outcomes.append((outcome, time.monotonic() - started))
            if outcome != "answered":
                time.sleep(1.0)  # Retry-After: 1, as an SDK honours it

    def _one(self, body: dict, headers: dict) -> str:
        url = self.live.url + "/chat/completions"
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=DEADLINE_S + SLACK_S) as response:
                if response.status_code != 200:
                    response.read()
                    ok = response.status_code in (429, 503) and "retry-after" in response.headers
                    return "refused" if ok else f"status {response.status_code}"
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        except httpx.TimeoutException:
            return "hung"
        except httpx.HTTPError:
            return "broken"
        if events[-1:] != ["[DONE]"]:
            return "broken"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return "refused"  # the stream's error event: the engine was replaced, or the deadline passed
        self.finished.append(chunks[-1]["lopd"]["trajectory_id"])
        return "answered"

    def _probe(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                httpx.get(self.live.root + "/health", timeout=5).raise_for_status()
                self.health_s.append(time.monotonic() - started)
                slowest = self.health_by_phase.get(self.phase, 0.0)
                self.health_by_phase[self.phase] = max(slowest, self.health_s[-1])
            except httpx.HTTPError:
                self.health_s.append(float("inf"))
            time.sleep(0.1)


def _wait_replaced(engine, restarts: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not (engine.ready and engine.restarts > restarts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.ready and engine.restarts > restarts, f"no new engine within {limit_s:g}s"


def _inject(engine, loaded) -> list[BaseException]:
    """An exception in the inbox loop (a malformed message) and in the worker loop (a seed torch refuses); both
    must fail their own request and leave the engine serving."""
    engine._link.post(("generate", "not a request"))

    async def bad_seed():
        return await engine.generate(loaded, [1, 2], temperature=1.0, top_p=1.0, max_tokens=2, seed=2**70)

    errors = []
    try:
        asyncio.run(bad_seed())
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    return errors


@pytest.mark.slow
def test_the_engine_process_under_faults(tiny_checkpoints, tmp_path):
    settings = dict(engine="process", engine_heartbeat_s=0.2, engine_timeout_s=3.0, request_timeout_s=DEADLINE_S)
    with make_server(tiny_checkpoints[0], tmp_path / "traces", max_batch=8, max_queue=8, **settings) as live:
        engine, holder = live.app.state.batcher, live.app.state.holder
        with Load(live, clients=16) as load:
            time.sleep(3)
            load.phase = "reloads"
            reloads = [
                httpx.post(live.root + "/admin/reload", json={"model": str(tiny_checkpoints[k % 2])}, timeout=600)
                for k in range(1, 5)
            ]
            load.phase = "injected"
            injected = _inject(engine, holder.current)
            time.sleep(2)
            load.phase = "killed"
            os.kill(engine._link.child.pid, signal.SIGKILL)
            _wait_replaced(engine, 0, 600)
            time.sleep(2)
            load.phase = "stopped"
            os.kill(engine._link.child.pid, signal.SIGSTOP)  # alive and deaf: its pipe fills; the watchdog replaces it
            _wait_replaced(engine, 1, 600)
            load.phase = "after"
            time.sleep(3)
        restarts = engine.restarts
        store = live.app.state.store
        lines = [line for f in sorted(store.dir.glob("traces-*.jsonl")) for line in f.read_text().splitlines()]
    records = [json.loads(line) for line in lines]  # a torn line would not parse
    recorded = {r["trajectory_id"] for r in records if r.get("kind") == "turn"}
    kinds = [o for o, _ in load.outcomes]
    print(
        f"requests {len(kinds)}: answered {kinds.count('answered')}, refused {kinds.count('refused')}, "
        f"other {len(kinds) - kinds.count('answered') - kinds.count('refused')}; restarts {restarts}; "
        f"health max {max(load.health_s):.3f}s over {len(load.health_s)} probes, by phase "
        f"{ {k: round(v, 3) for k, v in load.health_by_phase.items()} }; records {len(records)}; "
        f"slowest request {max(s for _, s in load.outcomes):.2f}s"
    )
    assert [r.status_code for r in reloads] == [200] * 4
    assert len(injected) == 1 and isinstance(injected[0], ValueError)
    assert restarts >= 2
    assert set(kinds) <= {"answered", "refused"}, [k for k in kinds if k not in ("answered", "refused")]
    assert max(s for _, s in load.outcomes) < DEADLINE_S + SLACK_S  # none hung
    assert kinds.count("answered") > 0 and max(load.health_s) < 1.0
    assert set(load.finished) <= recorded and len(load.finished) == len(set(load.finished))  # none lost

"""Faults of `lopd serve` under a 16-client load, measured side by side in one run (issue #32).

(a) kill -9: `lopd serve` in its own process, 16 client threads playing toolworld sessions through it with the
    project's client (lopd_serve/client.py `play`: one chat completion per turn, the tools run here, the reward
    posted as feedback); the server is killed with SIGKILL mid-load. Then the store is read back
    (`read_traces`: every record parsed and the table validated) and compared with what the clients saw: a
    session the client completed (every turn answered, feedback acknowledged) must be in the store, labeled,
    with the turns the client played; a torn last line is counted (skipped with a warning by the reader).
    A server restarted on the same store keeps recording (after a torn line it opens a new segment).
(b) hot swap: 16 clients hold 3-turn conversations; meanwhile `POST /admin/reload` swaps in another model folder
    (a copy of the served one: another version label, the same weights). Every request must be answered, and
    every recorded turn must name the version its response named; a trajectory never mixes versions (a session
    continued across the swap starts a new trajectory, origin `model_changed`).

(c) a full disk mid-load on a real small filesystem, then space freed: benchmarks/serve_disk_full.py.

Seeded (tasks, prompts and every request's sampling seed); what a run cannot fix is where the kill and the swap
land in the load, so the counts move between runs while the targets (0 lost, 0 failed, 0 mislabeled) do not.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_faults.py [--model data/base] [--clients 16]
        [--kill-after 6] [--swap-after 4] [--load-s 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import lopd_core  # noqa: F401  (offline defaults)

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, store: Path, log: Path, seed: int) -> tuple[subprocess.Popen, str]:
    """`lopd serve` in a process of its own on loopback; returns it and its root URL once /health answers."""
    import httpx

    port = _port()
    command = [sys.executable, "-m", "lopd_cli.main", "serve", "--model", str(model), "--port", str(port)]
    command += ["--store", str(store), "--poll-s", "0", "--device", "cpu", "--set", f"seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    with open(log, "a") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return proc, root
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"lopd serve did not come up: see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def read_store(store: Path):
    """The trace table and how many torn last lines the reader skipped (its warnings)."""
    from lopd_core.traces import read_traces

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = read_traces(store)
    return table, sum("torn" in str(w.message) for w in caught)


# ---- (a) kill -9 ---------------------------------------------------------------------------------------------
def kill_run(model: Path, work: Path, *, clients: int, kill_after: float, seed: int) -> dict:
    import openai

    from lopd_core.config import load_params
    from lopd_core.envs import make_tasks
    from lopd_core.envs.toolworld.worlds import WorldSplit
    from lopd_serve.client import play

    params = load_params(ROOT / "params.yaml")
    tasks = make_tasks("toolworld", "test_id", 4000, seed, WorldSplit.from_config(params.envs).for_split("test_id"))
    store = work / "store-kill"
    proc, root = serve(model, store, work / "server-kill.log", seed)
    client = openai.OpenAI(base_url=root + "/v1", api_key="none", max_retries=0, timeout=120)
    completed: dict[str, int] = {}  # session -> turns the client played
    started, lock, next_task = [], threading.Lock(), iter(range(len(tasks)))

    def worker(stop_at: int | None) -> None:
        while True:
            with lock:
                i = next(next_task, None)
            if i is None or (stop_at is not None and i >= stop_at):
                return
            session = f"{'kill' if stop_at is None else 'after'}-{i:05d}"
            with lock:
                started.append(session)
            try:
                episode = play(
                    client,
                    root + "/v1",
                    "none",
                    tasks[i],
                    model="base",
                    temperature=1.0,
                    max_tokens=48,
                    seed=seed + 1000 * i,
                    session=session,
                )
            except Exception:  # noqa: BLE001  the server is gone: this client stops
                return
            with lock:
                completed[session] = episode.turns

    threads = [threading.Thread(target=worker, args=(None,)) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(kill_after)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for t in threads:
        t.join()
    table, torn = read_store(store)
    killed_started, killed_completed = len(started), dict(completed)
    labeled = table[table["labeled"]]
    stored_turns = {row.session: int(row.num_turns) for row in labeled.itertuples()}
    lost = sorted(s for s in killed_completed if s not in stored_turns)
    wrong_turns = sorted(s for s, n in killed_completed.items() if s in stored_turns and stored_turns[s] != n)
    unacknowledged = sorted(s for s in stored_turns if s not in killed_completed)
    segments_before = len(list(store.glob("traces-*.jsonl")))

    # restart on the same store: a new segment, and every session of a short second load recorded
    proc, root = serve(model, store, work / "server-kill.log", seed)
    client = openai.OpenAI(base_url=root + "/v1", api_key="none", max_retries=0, timeout=120)
    with lock:
        resume_from = next(next_task)
    next_task = iter(range(resume_from, resume_from + clients))
    threads = [threading.Thread(target=worker, args=(resume_from + clients,)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop(proc)
    after, torn_after = read_store(store)
    after_sessions = {s for s in completed if s.startswith("after-")}
    after_labeled = set(after[after["labeled"]]["session"])
    return {
        "sessions started by clients": killed_started,
        "sessions completed by clients": len(killed_completed),
        "completed sessions found labeled in store": len(killed_completed) - len(lost),
        "completed sessions lost": len(lost),
        "completed sessions with other turns in store": len(wrong_turns),
        "labeled in store, client saw no ack": len(unacknowledged),
        "trajectories read back": len(table),
        "torn records skipped": torn,
        "restart: segments before / after": f"{segments_before} / {len(list(store.glob('traces-*.jsonl')))}",
        "restart: sessions completed / labeled": f"{len(after_sessions)} / {len(after_sessions & after_labeled)}",
        "restart: torn records skipped": torn_after,
    }


# ---- (b) hot swap --------------------------------------------------------------------------------------------
def swap_run(model: Path, work: Path, *, clients: int, swap_after: float, load_s: float, seed: int) -> dict:
    import random

    import httpx

    other = work / "model-b"
    shutil.copytree(model, other)
    store = work / "store-swap"
    proc, root = serve(model, store, work / "server-swap.log", seed)
    version_a = httpx.get(root + "/health").json()["model_version"]
    rng = random.Random(seed)
    prompts = [f"[cobalt] Send {rng.randint(1, 90)} to Lena from my checking account." for _ in range(64)]
    answered: list[tuple[str, str, float, float]] = []  # (trajectory id, version, sent, done)
    failures: list[str] = []
    lock, halt = threading.Lock(), threading.Event()

    def worker(k: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not halt.is_set():
                session = f"swap-{k:02d}-{n:04d}"
                messages = [{"role": "user", "content": prompts[(k * 7 + n) % len(prompts)]}]
                for turn in range(3):
                    body = {"messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": seed + k * 10**6 + n}
                    body["seed"] += 1000 * turn
                    sent = time.perf_counter()
                    try:
                        r = http.post(root + "/v1/chat/completions", json=body, headers={"X-Session-Id": session})
                    except httpx.HTTPError as exc:
                        with lock:
                            failures.append(f"{type(exc).__name__}")
                        break
                    if r.status_code != 200:
                        with lock:
                            failures.append(f"HTTP {r.status_code}: {r.text[:120]}")
                        break
                    out = r.json()
                    with lock:
                        answered.append(
                            (out["lopd"]["trajectory_id"], out["lopd"]["model_version"], sent, time.perf_counter())
                        )
                    messages = messages + [
                        {"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""},
                        {"role": "user", "content": "go on"},
                    ]
                n += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(swap_after)
    swap_start = time.perf_counter()
    reload = httpx.post(root + "/admin/reload", json={"model": str(other)}, timeout=300)
    swap_end = time.perf_counter()
    time.sleep(max(load_s - swap_after, 0.0))
    halt.set()
    for t in threads:
        t.join()
    stop(proc)
    version_b = reload.json().get("model_version") if reload.status_code == 200 else None

    from lopd_core.traces.store import read_records

    recorded: dict[str, list[str]] = defaultdict(list)
    for rec in read_records(store):
        if rec["kind"] == "turn":
            recorded[rec["trajectory_id"]].append(rec["model_version"])
    told: dict[str, list[str]] = defaultdict(list)
    for tid, version, _, _ in sorted(answered, key=lambda a: a[3]):
        told[tid].append(version)
    mislabeled = sum(
        1 for tid, versions in told.items() for a, b in zip(versions, recorded.get(tid, [])) if a != b
    ) + sum(abs(len(v) - len(recorded.get(t, []))) for t, v in told.items())
    table, torn = read_store(store)
    by_version = Counter(v for _, v, _, _ in answered)
    return {
        "requests answered": len(answered),
        "requests failed": len(failures),
        "reload status / seconds": f"{reload.status_code} / {swap_end - swap_start:.2f}",
        "requests in flight across the swap": sum(1 for _, _, s, d in answered if s < swap_end and d > swap_start),
        "answered by old / new version": f"{by_version[version_a]} / {by_version[version_b]}",
        "turns whose record names another version": mislabeled,
        "trajectories mixing versions": sum(1 for v in recorded.values() if len(set(v)) > 1),
        "trajectories origin model_changed": int((table["origin"] == "model_changed").sum()),
        "trajectories read back": len(table),
        "torn records skipped": torn,
        "failures (first 3)": "; ".join(failures[:3]) or "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "data" / "base"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kill-after", dest="kill_after", type=float, default=6.0)
    parser.add_argument("--swap-after", dest="swap_after", type=float, default=4.0)
    parser.add_argument("--load-s", dest="load_s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (stores and logs)")
    args = parser.parse_args()
    model = Path(args.model).resolve()
    work = Path(tempfile.mkdtemp(prefix="lopd-serve-faults-"))
    try:
        killed = kill_run(model, work, clients=args.clients, kill_after=args.kill_after, seed=args.seed)
        swapped = swap_run(
            model, work, clients=args.clients, swap_after=args.swap_after, load_s=args.load_s, seed=args.seed
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"lopd serve faults: {args.clients} clients, model {model.name}, seed {args.seed}")
    width = max(len(k) for k in [*killed, *swapped]) + 2
    print(f"{'(a) kill -9 after ' + str(args.kill_after) + ' s':<{width + 12}}(b) hot swap after {args.swap_after} s")
    rows_a, rows_b = list(killed.items()), list(swapped.items())
    for i in range(max(len(rows_a), len(rows_b))):
        a = f"{rows_a[i][0]}: {rows_a[i][1]}" if i < len(rows_a) else ""
        b = f"{rows_b[i][0]}: {rows_b[i][1]}" if i < len(rows_b) else ""
        print(f"{a:<{width + 12}}{b}")
    print(json.dumps({"kill": killed, "swap": swapped}, default=str))


if __name__ == "__main__":
    main()

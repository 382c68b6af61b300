"""Rollout throughput in process against `lopd serve` on loopback (one server, then two taking slices of the
tasks), side by side in one run, and whether the served rollouts equal the engine's.

The same toolworld requests are played greedily three ways: the in-process engine (`rollout`, kept KV cache),
over one `lopd serve` process, over two (lopd_core/rollout/served.py: one completions request per turn on token
ids, the environments in this process). Each server is its own process (`lopd serve --model DIR`), with
`--threads` torch threads, as the client. Prints JSON: generated tokens/s of each way (median of `--repeats`),
their ratios to local, the time of one weight sync (save + reload on every server), and the fidelity of the
served trajectories (ids equal, largest log-prob difference).

    .venv/bin/python benchmarks/served_rollouts.py [--tasks 16] [--samples 2] [--model data/base] [--threads 1]

Uses the embedded base at data/base when it exists (build it with `lopd base`), else a randomly initialised tiny
Qwen3 with a tokenizer fitted on demonstrations. On a machine with fewer cores than processes, the servers and
the client share them: the ratios then show the protocol's overhead, not what several GPUs would add.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from benchmarks.rollout_throughput import load_or_build
from lopd_core.envs import make_tasks
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, ServedBackend, rollout
from lopd_core.rollout.sync import sync_weights


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, work: Path, threads: int):
    """`lopd serve --model folder` in its own process on a free loopback port; returns (process, base URL)."""
    import subprocess
    import urllib.request

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    with open(work / f"server-{port}.log", "w") as log:  # the child keeps its own copy of the descriptor
        command = [
            sys.executable,
            "-m",
            "lopd_cli.main",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--poll-s",
            "0",
            "--device",
            "cpu",
            "--store",
            str(work / f"traces-{port}"),
        ]
        proc = subprocess.Popen(
            command,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"lopd serve did not come up: see {work}/server-{port}.log")


def timed(play, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = play()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def fidelity(local, remote) -> dict:
    same = all(a.token_ids == b.token_ids for a, b in zip(local, remote))
    diff = max(
        (abs(x - y) for a, b in zip(local, remote) for x, y in zip(a.sample_logprobs, b.sample_logprobs)), default=0.0
    )
    return {"ids_equal": same, "max_abs_logprob_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--model", default="data/base")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the client and of each server")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, label = load_or_build(args.model)
    codec = make_chat(tokenizer)
    requests = [
        RolloutRequest(t, sample_index=g)
        for t in make_tasks("toolworld", "test_id", args.tasks, seed=3)
        for g in range(args.samples)
    ]
    greedy = Sampling(temperature=0.0, max_new_tokens=args.max_new_tokens, max_context=1024)
    work = Path(tempfile.mkdtemp(prefix="lopd-served-bench-"))
    folder = work / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    servers = [start_server(folder, work, args.threads) for _ in range(2)]
    try:
        local_s, local = timed(
            lambda: rollout(model, codec, requests, sampling=greedy, batch_size=len(requests)), args.repeats
        )
        results = {"local": {"seconds": local_s}}
        for n in (1, 2):
            backend = ServedBackend(tuple(url for _, url in servers[:n]))
            sampling = dataclasses.replace(greedy, served=backend)
            # model=None: the servers already serve these weights (the sync is timed on its own below)
            seconds, remote = timed(lambda s=sampling: rollout(None, codec, requests, sampling=s), args.repeats)
            results[f"served_{n}"] = {"seconds": seconds, **fidelity(local, remote)}
        started = time.perf_counter()
        sync_weights(model, tokenizer, [url for _, url in servers])
        sync_s = time.perf_counter() - started
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    tokens = sum(t.num_action_tokens for t in local)
    for row in results.values():
        row["tokens_per_s"] = round(tokens / row["seconds"], 1)
        row["seconds"] = round(row["seconds"], 3)
    speed = {name: row["tokens_per_s"] for name, row in results.items()}
    print(
        json.dumps(
            {
                "model": label,
                "trajectories": len(requests),
                "action_tokens": tokens,
                "turns": sum(t.num_turns for t in local),
                "threads": args.threads,
                **results,
                "ratio_served_1_over_local": round(speed["served_1"] / speed["local"], 3),
                "ratio_served_2_over_local": round(speed["served_2"] / speed["local"], 3),
                "ratio_served_2_over_served_1": round(speed["served_2"] / speed["served_1"], 3),
                "weight_sync_seconds_2_servers": round(sync_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

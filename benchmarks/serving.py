"""`lopd serve` against the in-process batched engine: generated tokens/s and request latency at 1, 4 and 16
concurrent clients, in one run, on one model.

Each engine (`serve.engine`: the decoder in a process of its own, or on a thread of the server) runs behind its
own `lopd serve`, a process of its own; each client is a thread here sending chat completions (each its own
session, the same first turn, its own seed) over HTTP with the official openai package. The reference runs
`generate_turn` in this process on batches of the same size and the same contexts: the ratio server/engine is what
HTTP, JSON, sessions, trace writes and the scheduling cost, and server c16/c1 is what batching buys. Per level,
`--repeats` rounds (at least `--min-rounds` requests per client each) alternate both servers and the reference, the
servers' order turned each round, and the median round of each engine is reported with every round's ratio: on a
shared machine a load that comes and goes then falls on every side, and `faster_at_c16` names the engine that
`serve.engine` should default to. Per level it also says where each server's time went: the decoder's busy share
of the wall time, its CPU while busy (below 1 when it waited for the interpreter lock or a core) and the CPU of
the server and of the clients.
A tiny random model (or --model DIR) on CPU by default: the ratios, not the absolute figures, are what carries
over. One torch thread per process, as every figure of the project is taken (the decoder, the server and the
clients then each have a core's worth of work on a 2-core machine):

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/serving.py [--model DIR] [--requests 64] \
        [--max-tokens 32] [--engine both|process|thread] [--repeats 5] [--min-rounds 16] [--width 64 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lopd_core  # noqa: F401  (offline defaults)


def tiny_checkpoint(folder: Path, width: int = 64, layers: int = 2) -> Path:
    import torch

    from lopd_core.config import TinyModelConfig
    from lopd_core.model.demos import build_demos
    from lopd_core.model.loading import tiny_qwen3
    from lopd_core.model.tokenizer import train_tokenizer

    demos = build_demos(n=120, experience_fraction=0.4, max_experiences=2, convention_noise=0.5, slip=0.1, seed=0)
    tokenizer = train_tokenizer((d.text() for d in demos), vocab_size=600)
    torch.manual_seed(0)
    cfg = TinyModelConfig(
        hidden_size=width, num_layers=layers, num_heads=4, num_kv_heads=2, intermediate_size=2 * width
    )
    tiny_qwen3(cfg, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(round(q * (len(ordered) - 1)), len(ordered) - 1)]


def clients(client, messages: list[dict], level: int, per_client: int, max_tokens: int):
    """`level` threads, each sending `per_client` requests in turn; returns latencies, tokens and wall time."""
    latencies, tokens, lock = [], [], threading.Lock()

    def worker(k: int) -> None:
        for i in range(per_client):
            t0 = time.perf_counter()
            r = client.chat.completions.create(
                model="m", messages=messages, max_tokens=max_tokens, seed=1000 * k + i, temperature=1.0
            )
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens.append(r.usage.completion_tokens)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, tokens, time.perf_counter() - started


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_round(client, health, server_pid, messages, level, per_client, args) -> dict:
    """`level` clients through one server: its throughput, latencies and where its time went."""
    import httpx

    before = httpx.get(health).json()["engine"]
    server_cpu, client_cpu = process_cpu_s(server_pid), time.process_time()
    latencies, tokens, server_s = clients(client, messages, level, per_client, args.max_tokens)
    after = httpx.get(health).json()["engine"]
    server_cpu, client_cpu = process_cpu_s(server_pid) - server_cpu, time.process_time() - client_cpu
    busy = after["busy_s"] - before["busy_s"]
    return {
        "requests": len(latencies),
        "server_tokens_per_s": round(sum(tokens) / server_s, 1),
        "latency_p50_s": round(statistics.median(latencies), 4),
        "latency_p95_s": round(percentile(latencies, 0.95), 4),
        "mean_tokens_per_request": round(sum(tokens) / len(tokens), 1),
        # where the server's time went: the decoder's share of the wall time, its CPU while busy (below 1: it
        # waited for the interpreter lock or for a core), the server process's CPU (the engine process's aside)
        # and the clients' CPU
        "engine_busy_fraction": round(busy / server_s, 3),
        # rows in the decoder's batch, on average over its steps (of `level`: a request being answered, sent
        # again and rendered is not in it)
        "rows_per_step": round((after["tokens"] - before["tokens"]) / max(after["steps"] - before["steps"], 1), 2),
        "engine_cpu_over_busy": round((after["cpu_s"] - before["cpu_s"]) / max(busy, 1e-9), 3),
        "server_cpu_s": round(server_cpu, 2),
        "client_cpu_s": round(client_cpu, 2),
        "server_s": round(server_s, 2),
    }


def engine_round(loaded, context, level, per_client, args) -> dict:
    """The same work on the engine in this process, `level` rows per batch, no HTTP."""
    import torch

    from lopd_core.rollout.engine import Sampling, generate_turn

    engine_tokens, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    for b in range(per_client):
        turns = generate_turn(
            loaded.model,
            [context] * level,
            sampling=Sampling(temperature=1.0, max_new_tokens=args.max_tokens),
            stop_id=loaded.chat.im_end_id,
            pad_id=loaded.chat.pad_id,
            generator=[torch.Generator().manual_seed(1000 * k + b) for k in range(level)],
        )
        engine_tokens += sum(len(ids) for ids, _ in turns)
    engine_s, engine_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    # a shared machine gives the two sides different shares of a core: this says what the reference got
    return {
        "engine_tokens_per_s": round(engine_tokens / engine_s, 1),
        "reference_cpu_over_wall": round(engine_cpu / engine_s, 3),
    }


def start_server(folder: Path, store: Path, engine: str):
    """`lopd serve` in a process of its own, as deployed (clients here would otherwise share its interpreter
    lock); returns the process, its /health URL and an openai client."""
    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "lopd_cli.main", "serve", "--model", str(folder), "--port", str(port)]
    command += ["--store", str(store), "--poll-s", "0", "--set", f"serve.engine={engine}"]
    server = subprocess.Popen(
        command,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    health = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the {engine} server did not start") from None
                time.sleep(0.2)
    except BaseException:  # not started (or Ctrl-C meanwhile): not left behind in its own session
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        raise
    return server, health, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def median_round(runs: list[dict]) -> dict:
    """The round with the median ratio, and every round's ratio beside it."""
    ordered = sorted(runs, key=lambda run: run["server_over_engine"])
    return {**ordered[len(ordered) // 2], "server_over_engine_runs": [run["server_over_engine"] for run in ordered]}


def measure(servers: dict, loaded, engines: list[str], args) -> tuple[dict, dict]:
    """Per level, `--repeats` rounds of every engine's server and the in-process reference; each engine's median
    round per level, and each server's /health figures at the end."""
    import httpx

    messages = [{"role": "system", "content": "tools: lookup(key)"}, {"role": "user", "content": "find key a"}]
    context = loaded.chat.start(messages[0]["content"], messages[1]["content"]).token_ids
    for _, _, client in servers.values():
        client.chat.completions.create(model="m", messages=messages, max_tokens=4, seed=0)  # warm up

    results: dict[str, dict] = {e: {} for e in engines}
    for level in [int(x) for x in args.levels.split(",")]:
        per_client = max(args.requests // level, args.min_rounds)
        runs: dict[str, list] = {e: [] for e in engines}
        for r in range(args.repeats):
            # the engines and the in-process reference alternate, the engines' order turned every round: a load
            # that comes and goes falls on every side, and neither engine always runs first
            order = engines if r % 2 == 0 else engines[::-1]
            rounds = {
                e: server_round(servers[e][2], servers[e][1], servers[e][0].pid, messages, level, per_client, args)
                for e in order
            }
            reference = engine_round(loaded, context, level, per_client, args)
            for e, run in rounds.items():
                ratio = run["server_tokens_per_s"] / reference["engine_tokens_per_s"]
                runs[e].append({**run, **reference, "server_over_engine": round(ratio, 3)})
            print(
                f"c{level} round {r + 1}/{args.repeats}: "
                + ", ".join(f"{e} {runs[e][-1]['server_over_engine']}x" for e in engines),
                file=sys.stderr,
                flush=True,
            )
        for e in engines:
            results[e][level] = median_round(runs[e])
    stats = {e: httpx.get(servers[e][1]).json() for e in engines}
    return results, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random model)")
    parser.add_argument(
        "--width",
        type=int,
        default=64,
        help="hidden size of the random model (layers: --layers): the server's cost per step is fixed, the model's "
        "grows with it, so a wider model shows how the ratio moves with the model's share of a step",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level and round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--min-rounds", type=int, default=16, help="requests per client at the least")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per level (the median is reported)")
    parser.add_argument(
        "--engine", default="both", choices=["both", "process", "thread"], help="serve.engine (both: alternate them)"
    )
    args = parser.parse_args()

    import torch

    from lopd_serve.models import load_checkpoint

    work = Path(tempfile.mkdtemp(prefix="lopd-serve-bench-"))
    folder = Path(args.model) if args.model else tiny_checkpoint(work / "model", args.width, args.layers)
    loaded = load_checkpoint(folder, device="cpu")
    engines = ["process", "thread"] if args.engine == "both" else [args.engine]
    servers: dict = {}
    try:  # the servers run in sessions of their own: stopped here whatever ends the run (an error, Ctrl-C)
        for e in engines:
            servers[e] = start_server(folder, work / f"traces-{e}", e)
        results, stats = measure(servers, loaded, engines, args)
    finally:
        for server, _, _ in servers.values():
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    levels = sorted(results[engines[0]])
    top = levels[-1]
    out = {
        "device": "cpu",
        "model": args.model or f"random, hidden {args.width}, {args.layers} layers",
        "torch_threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "engines": {
            e: {
                "server_decode_steps": stats[e]["batches"],
                "server_requests": stats[e]["batched_requests"],
                "levels": results[e],
                f"server_over_engine_c{top}": results[e][top]["server_over_engine"],
                f"server_c{top}_over_c{levels[0]}": round(
                    results[e][top]["server_tokens_per_s"] / results[e][levels[0]]["server_tokens_per_s"], 2
                ),
            }
            for e in engines
        },
    }
    if len(engines) > 1:  # the default engine should be this one (serve.engine)
        out[f"faster_at_c{top}"] = max(engines, key=lambda e: results[e][top]["server_over_engine"])
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

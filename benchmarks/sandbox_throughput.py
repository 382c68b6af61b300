"""Sandbox throughput: executions per second, one at a time vs a SandboxPool, side by side in one run.

Each execution is a codegen-style job (define a function, call it on 7 inputs) in a fresh, fully isolated
child, so the figure is what grading costs during rollouts. Prints JSON.

    python benchmarks/sandbox_throughput.py [--runs 40] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from lopd_core.envs.codegen.grading import CODEGEN_LIMITS
from lopd_core.envs.sandbox import SandboxPool, run_job

SOURCE = (
    "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n"
    "        total += x\n        out.append(total)\n    return out\n"
)


def job(i: int) -> dict:
    inputs = [[list(range(i, i + k))] for k in range(7)]
    return {"mode": "calls", "source": SOURCE, "function": "running_sum", "inputs": inputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jobs = [job(i) for i in range(args.runs)]

    started = time.perf_counter()
    serial = [run_job(j, CODEGEN_LIMITS) for j in jobs]
    serial_s = time.perf_counter() - started

    with SandboxPool(args.workers) as pool:
        started = time.perf_counter()
        pooled = pool.map_jobs(jobs, CODEGEN_LIMITS)
        pooled_s = time.perf_counter() - started

    assert all(r.status == "ok" for r in serial + pooled), "a benchmark job failed"
    print(
        json.dumps(
            {
                "runs": args.runs,
                "workers": args.workers,
                "cpus": os.cpu_count(),
                "serial_exec_per_s": round(args.runs / serial_s, 2),
                "pooled_exec_per_s": round(args.runs / pooled_s, 2),
                "speedup": round(serial_s / pooled_s, 2),
                "mean_run_ms": round(1000 * sum(r.duration_s for r in serial) / len(serial), 1),
                "isolation": serial[0].isolation,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

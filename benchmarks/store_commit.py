"""Group commit of the trace store against one fsync per record, side by side in one run (issue #47 item 3).

N writer threads append turn records of a realistic size (a served turn: a few hundred ids, log-probs and
messages) to one `TraceStore`, as N concurrent requests do, each `append` returning only once the fsync that covers
its record has. Each round writes `--records` records with one-per-fsync (`group_commit=False`, the old store)
and then with group commit, each into a fresh store folder under `--dir`, alternating `--rounds` times; printed
per mode: records/s and fsyncs per record (median over the rounds, and the range), then every record is read
back (the count must match: nothing lost, nothing torn).

    PYTHONPATH=. .venv/bin/python benchmarks/store_commit.py [--writers 16] [--records 640] [--rounds 3]
        [--dir FOLDER] [--ids 300]

What it measures is the store's own cost on the disk under `--dir` (default: a temporary folder; its filesystem's
fsync decides the figures): a tmpfs fsyncs in no time, a real disk in tens of microseconds to milliseconds.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.traces import TraceStore, read_records


def record(rng: random.Random, writer: int, k: int, ids: int) -> dict:
    """A turn 0 of about the size a served turn writes (ids, mask, log-probs, two messages)."""
    return {
        "kind": "turn",
        "trajectory_id": f"w{writer}-{k}",
        "turn": 0,
        "session": f"s{writer}",
        "origin": "new",
        "parent": "",
        "model_version": "bench",
        "prompt_length": ids // 2,
        "token_ids": [rng.randrange(150_000) for _ in range(ids)],
        "action_mask": [0] * (ids // 2) + [1] * (ids - ids // 2),
        "sample_logprobs": [0.0] * (ids // 2) + [round(-rng.random(), 4) for _ in range(ids - ids // 2)],
        "finish_reason": "stop",
        "messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y" * 200}],
        "time": time.time(),
        "tools": [],
    }


def one_run(folder: Path, *, grouped: bool, writers: int, records: int, ids: int) -> dict:
    """`records` records from `writers` threads into a fresh store: records/s, fsyncs per record, read back."""
    rng = random.Random(0)
    each = records // writers
    payload = [[record(rng, w, k, ids) for k in range(each)] for w in range(writers)]
    store = TraceStore(folder, segment_bytes=64 << 20, max_bytes=1 << 40, group_commit=grouped)
    start = threading.Barrier(writers + 1)

    def write(w: int) -> None:
        start.wait()
        for rec in payload[w]:
            store.append(rec)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    store.close()
    found = sum(1 for _ in read_records(folder))
    return {
        "records_per_s": store.records / seconds,
        "fsyncs_per_record": store.fsyncs / store.records,
        "written": store.records,
        "found": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--records", type=int, default=640, help="records per run (split over the writers)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both modes")
    parser.add_argument("--ids", type=int, default=300, help="token ids per record")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-commit-", dir=args.dir))
    runs: dict[str, list[dict]] = {"one-per-fsync": [], "grouped": []}
    try:
        for r in range(args.rounds):
            for mode in runs:
                folder = root / f"{mode}-{r}"
                runs[mode].append(
                    one_run(folder, grouped=mode == "grouped", writers=args.writers, records=args.records, ids=args.ids)
                )
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.writers} writers, {args.records} records of {args.ids} ids per run, {args.rounds} rounds, in {root}")
    print(f"{'mode':<14} {'records/s (median, range)':<32} {'fsyncs/record (median)':<24} lost")
    for mode, results in runs.items():
        rates = [x["records_per_s"] for x in results]
        per = statistics.median(x["fsyncs_per_record"] for x in results)
        lost = sum(x["written"] - x["found"] for x in results)
        span = f"{statistics.median(rates):8.0f} ({min(rates):.0f}-{max(rates):.0f})"
        print(f"{mode:<14} {span:<32} {per:<24.3f} {lost}")
    speedup = statistics.median(x["records_per_s"] for x in runs["grouped"]) / statistics.median(
        x["records_per_s"] for x in runs["one-per-fsync"]
    )
    print(f"grouped / one-per-fsync: {speedup:.2f}x records/s")


if __name__ == "__main__":
    main()

"""A full disk under a 16-client load of `lopd serve`, on a real small filesystem, then space freed (issue #39).

The store lives on a tmpfs this script mounts (`mount -t tmpfs -o size=...`: root or CAP_SYS_ADMIN; elsewhere it
says so and stops). A filler file takes all but `--headroom` bytes of it, so the store's own writes fill the disk
mid-load: the kernel's short writes and ENOSPC, not an injected fault. `lopd serve` runs in its own process; 16
client threads each hold two-turn conversations (a user message, the reply sent back with a second message)
and label each through /v1/feedback. A client told 507 (disk full) waits and sends the same request again, as
a client of a server that says "free space, then retry" would. `--full-for` seconds after the first 507 the
filler is deleted; the load goes on to `--load-s`, the server is stopped and the store read back.

Printed: conversations the clients were answered for and whose label was acknowledged (answered-labeled), how
many of them the store holds labeled with both turns (found), lost (answered-labeled − found: must be 0), torn
records the reader skipped, lines `lopd serve store check` finds bad, and the 507s (turns, feedback).

    PYTHONPATH=. .venv/bin/python benchmarks/serve_disk_full.py [--model DIR] [--clients 16] [--fs-bytes N]
        [--headroom N] [--full-for 3] [--load-s 20] [--seed 0]

Without --model (and no data/base), a randomly initialised tiny Qwen3 is built: what is measured is the store
under a full disk, not what the model says.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from serve_faults import ROOT, read_store, serve, stop  # the sibling script (its folder leads sys.path)
from serving import tiny_checkpoint  # the throughput benchmark's tiny random checkpoint

import lopd_core  # noqa: F401  (offline defaults)

RETRY_S = 0.2  # a client's wait before it sends a request the server refused with 507 again


@contextlib.contextmanager
def small_filesystem(folder: Path, size_bytes: int):
    """A tmpfs of `size_bytes` at `folder`; raises PermissionError with the reason where mounting is refused."""
    folder.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)]
    try:
        subprocess.run(mount, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = getattr(exc, "stderr", "") or str(exc)
        raise PermissionError(f"cannot mount a tmpfs at {folder} ({why.strip()}): run as root") from None
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)


def fill(folder: Path, headroom: int) -> Path:
    """A filler file leaving about `headroom` bytes of the filesystem free."""
    free = shutil.disk_usage(folder).free
    filler = folder / "filler"
    with open(filler, "wb") as out:
        out.write(b"\0" * max(free - headroom, 0))
    return filler


def disk_full_run(
    model: Path, work: Path, *, clients: int, fs_bytes: int, headroom: int, full_for: float, load_s: float, seed: int
) -> dict:
    import httpx

    fs = work / "fs"
    with small_filesystem(fs, fs_bytes):
        store = fs / "store"
        proc, root = serve(model, store, work / "server-disk-full.log", seed)
        filler = fill(fs, headroom)
        lock, halt = threading.Lock(), threading.Event()
        answered_labeled: dict[str, str] = {}  # session -> trajectory id, every turn and the label acknowledged
        counts = {"507 turns": 0, "507 feedback": 0, "other failures": 0}
        first_full: list[float] = []
        started = time.perf_counter()

        def send(http: httpx.Client, path: str, body: dict, kind: str) -> httpx.Response | None:
            """The request until it is not a 507 (or the load ends); None on anything but 200."""
            while True:
                try:
                    r = http.post(root + path, json=body)
                except httpx.HTTPError:
                    r = None
                if r is not None and r.status_code == 507:
                    with lock:
                        counts[f"507 {kind}"] += 1
                        first_full[:] = first_full or [time.perf_counter() - started]
                    if halt.is_set():
                        return None
                    time.sleep(RETRY_S)
                    continue
                if r is None or r.status_code != 200:
                    with lock:
                        counts["other failures"] += 1
                    return None
                return r

        def worker(k: int) -> None:
            with httpx.Client(timeout=120) as http:
                for n in itertools.count():
                    if halt.is_set():
                        return
                    session = f"full-{k:02d}-{n:04d}"
                    messages = [{"role": "user", "content": f"[cobalt] Send {k + n} to Lena, conversation {n}."}]
                    body = {"max_tokens": 16, "temperature": 1.0, "seed": seed + 1000 * k + n, "user": session}
                    first = send(http, "/v1/chat/completions", {**body, "messages": messages}, "turns")
                    if first is None:
                        continue
                    reply = first.json()["choices"][0]["message"]
                    messages += [reply, {"role": "user", "content": "And then?"}]
                    second = send(http, "/v1/chat/completions", {**body, "messages": messages}, "turns")
                    if second is None:
                        continue
                    label = {"session": session, "reward": 1.0, "success": True}
                    if send(http, "/v1/feedback", label, "feedback") is not None:
                        with lock:
                            answered_labeled[session] = second.json()["lopd"]["trajectory_id"]

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        freed_at = None
        while time.perf_counter() - started < load_s:
            if freed_at is None and first_full and time.perf_counter() - started > first_full[0] + full_for:
                filler.unlink()
                freed_at = time.perf_counter() - started
            time.sleep(0.05)
        if freed_at is None:
            filler.unlink(missing_ok=True)
        halt.set()
        for t in threads:
            t.join()
        stop(proc)
        table, torn = read_store(store)
        from lopd_core.traces.repair import check_store

        bad = check_store(store)
    labeled = table[table["labeled"] & table["success"]].set_index("trajectory_id")
    found = sum(1 for tid in answered_labeled.values() if tid in labeled.index and labeled.loc[tid, "num_turns"] == 2)
    return {
        "clients": clients,
        "filesystem bytes / headroom": f"{fs_bytes} / {headroom}",
        "disk full at s (first 507)": round(first_full[0], 2) if first_full else None,
        "space freed at s": round(freed_at, 2) if freed_at is not None else None,
        "answered-labeled": len(answered_labeled),
        "found labeled in store": found,
        "lost": len(answered_labeled) - found,
        "trajectories read back": len(table),
        "torn records skipped": torn,
        "bad lines (store check)": len(bad),
        **counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--fs-bytes", dest="fs_bytes", type=int, default=4 << 20)
    parser.add_argument("--headroom", type=int, default=256 << 10)
    parser.add_argument("--full-for", dest="full_for", type=float, default=3.0)
    parser.add_argument("--load-s", dest="load_s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lopd-serve-disk-full-"))
    try:
        base = ROOT / "data" / "base"
        model = Path(args.model) if args.model else base if (base / "config.json").exists() else None
        model = model.resolve() if model else tiny_checkpoint(work / "tiny")
        try:
            out = disk_full_run(
                model,
                work,
                clients=args.clients,
                fs_bytes=args.fs_bytes,
                headroom=args.headroom,
                full_for=args.full_for,
                load_s=args.load_s,
                seed=args.seed,
            )
        except PermissionError as exc:
            print(f"skipped: {exc}")
            return
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"lopd serve, disk full mid-load on a tmpfs then freed: model {model.name}, seed {args.seed}")
    for key, value in out.items():
        print(f"  {key}: {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

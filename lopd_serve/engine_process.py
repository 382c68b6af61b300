"""The decoder in a process of its own (`serve.engine: process`, the default).

Why: in one process, the server's Python work (HTTP, pydantic, rendering, tokenizing, JSON, trace writes) and the
decoding loop's own Python (a step of a small model is mostly interpreter time) take turns on one interpreter
lock, so every request handled is time the decoder does not decode. vLLM moved its engine into a process of its
own for this reason. Here the same worker as the thread mode's (batching.Worker: continuous batches) runs in a
child process started with `spawn` (no CUDA or thread state inherited); the server sends it token ids and sampling
settings and gets sampled ids back, token by token for a stream. Rendering, tokenizing and every check stay in the
server, which keeps its own copy of each model (on the CPU) for them and for a reload's smoke test.

Messages, pickled tuples over two pipes:

    to the engine     ("load", key, folder, version, name)  ("generate", rid, key, context, sampling, stream)
                      ("score", rid, key, ids, top_k)        ("cancel", rid)   ("stop",)
    from the engine   ("ready",)  ("loaded", key, error)  ("token", rid, id, logprob, top)
                      ("done", rid, result, error)  ("stats", counters)

The engine loads a model version from its folder (`LoadedModel.folder`) on `serve.device` the first time it is
named (ModelHolder.before_swap names a new one before the swap), and keeps the versions rows are decoded with plus
the latest ones. It exits when the server's end of the pipe closes (the server stopped or was killed). If it dies,
the requests waiting on it fail and the next request starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections import OrderedDict

from lopd_core.rollout.scoring import SequenceScores
from lopd_serve.batching import Generated, Job, ScoreJob, SeedStream, Worker, worker_future
from lopd_serve.models import load_checkpoint

log = logging.getLogger("lopd.serve")
MODELS_KEPT = 2  # versions the engine keeps loaded beyond those rows are decoded with
STATS_EVERY_S = 0.2  # how often the engine reports its counters (health, the benchmark)


class EngineProcess:
    """The decoder's API as Batcher's (generate, score, draw_seed, counters), served by a child process."""

    def __init__(self, *, window_s: float, max_batch: int, seed: int = 0, device: str = "auto"):
        self.window_s, self.max_batch, self.device = window_s, max_batch, device
        self.seeds = SeedStream(seed)
        self._ids = itertools.count()
        self._pending: dict[int, tuple] = {}  # rid -> (deliver, on_token)
        self._loaded: dict[str, threading.Event] = {}  # model key -> set once the engine answered its load
        self._load_errors: dict[str, str | None] = {}
        self._send_lock = threading.Lock()
        self._child = self._inbox = self._outbox = None
        self._stopping = False
        self.batches = self.rows = self.tokens = 0
        self.busy_s = self.cpu_s = 0.0

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine and wait until it runs (it imports torch and transformers: seconds)."""
        context = multiprocessing.get_context("spawn")
        inbox_read, inbox_write = context.Pipe(duplex=False)
        outbox_read, outbox_write = context.Pipe(duplex=False)
        self._child = context.Process(
            target=engine_main,
            args=(inbox_read, outbox_write),
            kwargs={"window_s": self.window_s, "max_batch": self.max_batch, "device": self.device},
            name="lopd-serve-engine",
            daemon=True,
        )
        self._child.start()
        inbox_read.close()
        outbox_write.close()
        self._inbox, self._outbox = inbox_write, outbox_read
        if self._outbox.recv() != ("ready",):
            raise RuntimeError("the engine process did not start")
        self._loaded, self._load_errors = {}, {}
        threading.Thread(target=self._read, name="lopd-serve-engine-reader", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError, AttributeError):  # never started, or already gone
            self._send(("stop",))
        if self._child is not None:
            self._child.join(timeout=30)
            if self._child.is_alive():
                self._child.kill()

    def draw_seed(self) -> int:
        return self.seeds.draw()

    def prepare(self, loaded) -> None:
        """Have the engine load `loaded` now and wait for it (blocking: run off the event loop)."""
        key = self._key(loaded)
        self._loaded[key].wait()
        if self._load_errors.get(key):
            raise RuntimeError(f"the engine process could not load {loaded.version}: {self._load_errors[key]}")

    # ---- requests --------------------------------------------------------------------------------------
    async def generate(self, loaded, context: list[int], *, on_token=None, **sampling) -> Generated:
        """Decode one turn (sampling: temperature, top_p, max_tokens, seed, top_logprobs); `on_token(id,
        logprob, top)` runs in this process's reader thread for each kept token."""
        rid, future = self._expect(on_token)
        self._send(("generate", rid, self._key(loaded), list(context), sampling, on_token is not None))
        try:
            return await future
        except asyncio.CancelledError:
            self._pending.pop(rid, None)
            self._send(("cancel", rid))  # the row leaves its batch before the engine's next step
            raise

    async def score(self, loaded, ids: list[int], *, top_k: int) -> SequenceScores:
        rid, future = self._expect(None)
        self._send(("score", rid, self._key(loaded), list(ids), top_k))
        return await future

    def _expect(self, on_token):
        if self._child is None or not self._child.is_alive():
            self._restart()
        rid = next(self._ids)
        future, deliver = worker_future()
        self._pending[rid] = (deliver, on_token)
        return rid, future

    def _key(self, loaded) -> str:
        """The engine's name for a model (its version); asks the engine to load it the first time."""
        key = loaded.version
        if key not in self._loaded:
            self._loaded[key] = threading.Event()
            self._send(("load", key, loaded.folder, loaded.version, loaded.name))
        return key

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._inbox.send(message)

    def _restart(self) -> None:
        log.warning("the engine process is not running: starting a new one")
        self.start()

    # ---- the reader thread: what the engine answers ----------------------------------------------------
    def _read(self) -> None:
        outbox = self._outbox
        while True:
            try:
                message = outbox.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "token":
                _, rid, token_id, logprob, top = message
                entry = self._pending.get(rid)
                if entry is not None and entry[1] is not None:
                    entry[1](token_id, logprob, top)
            elif kind == "done":
                _, rid, result, error = message
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    entry[0](result, error)
            elif kind == "loaded":
                _, key, error = message
                self._load_errors[key] = error
                self._loaded.setdefault(key, threading.Event()).set()
            elif kind == "stats":
                (self.batches, self.rows, self.tokens, self.busy_s, self.cpu_s) = message[1]
        self._lost()

    def _lost(self) -> None:
        """The engine's end closed: every request waiting on it fails (a new engine serves the next ones)."""
        pending, self._pending = self._pending, {}
        for event in self._loaded.values():
            event.set()
        if not self._stopping:
            log.warning("the engine process stopped; %d requests in flight failed", len(pending))
        for deliver, _ in pending.values():
            deliver(None, RuntimeError("the engine process stopped"))


# ---- the engine process ------------------------------------------------------------------------------------
def engine_main(inbox, outbox, *, window_s: float, max_batch: int, device: str) -> None:
    """The child's main: the worker decodes in this thread; a reader thread turns messages into jobs; a reporter
    sends the counters. Exits when the server's end of the inbox closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops its engine
    worker = Worker(window_s=window_s, max_batch=max_batch)
    send = _Sender(outbox)
    threading.Thread(target=_serve_inbox, args=(inbox, worker, send, device), daemon=True).start()
    threading.Thread(target=_report, args=(worker, send), daemon=True).start()
    send(("ready",))
    worker.run()


class _Sender:
    """One message at a time on the outbox (the worker, the reader and the reporter all send)."""

    def __init__(self, outbox):
        self.outbox, self.lock = outbox, threading.Lock()

    def __call__(self, message: tuple) -> None:
        with contextlib.suppress(OSError, ValueError), self.lock:  # the server gone: the inbox's end says so
            self.outbox.send(message)


def _report(worker: Worker, send: _Sender) -> None:
    last = None
    while True:
        time.sleep(STATS_EVERY_S)
        counters = tuple(getattr(worker, name) for name in Worker.COUNTERS)
        if counters != last:
            send(("stats", counters))
            last = counters


def _serve_inbox(inbox, worker: Worker, send: _Sender, device: str) -> None:
    models: OrderedDict[str, object] = OrderedDict()
    jobs: dict[int, Job] = {}
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the server stopped or died: so does its engine
            os._exit(0)
        kind = message[0]
        if kind == "stop":
            worker.submit(None)
            return
        if kind == "load":
            _load(models, message, send, device, in_use=worker.models())
        elif kind == "cancel":
            job = jobs.pop(message[1], None)
            if job is not None:
                job.gone = True
        elif kind in ("generate", "score"):
            _submit(message, models, jobs, worker, send)


def _load(models: OrderedDict, message: tuple, send: _Sender, device: str, *, in_use: list) -> None:
    _, key, folder, version, name = message
    try:
        models[key] = load_checkpoint(folder, version=version, name=name, device=device)
    except Exception as exc:  # noqa: BLE001  the server hears why; requests naming it fail
        send(("loaded", key, f"{type(exc).__name__}: {exc}"))
        return
    used = {id(m) for m in in_use}
    for old in [k for k in models if k != key][: max(len(models) - 1 - MODELS_KEPT, 0)]:
        if id(models[old]) not in used:
            del models[old]
    send(("loaded", key, None))


def _submit(message: tuple, models: dict, jobs: dict, worker: Worker, send: _Sender) -> None:
    rid, key = message[1], message[2]

    def deliver(result, exc) -> None:
        jobs.pop(rid, None)
        send(("done", rid, result, _portable(exc)))

    loaded = models.get(key)
    if loaded is None:
        deliver(None, RuntimeError(f"the engine has no model {key} (its load failed)"))
        return
    if message[0] == "score":
        worker.submit(ScoreJob(loaded, message[3], message[4], deliver))
        return
    _, _, _, context, sampling, stream = message
    on_token = (lambda token_id, logprob, top: send(("token", rid, token_id, logprob, top))) if stream else None
    jobs[rid] = Job(loaded, context, deliver=deliver, on_token=on_token, **sampling)
    worker.submit(jobs[rid])


def _portable(exc: Exception | None) -> Exception | None:
    """The exception itself when it crosses the pipe, else one that says what it was."""
    if exc is None:
        return None
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")

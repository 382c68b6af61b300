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
                      ("score", rid, key, ids, top_k)        ("cancel", rid)   ("ping", stamp)   ("stop",)
    from the engine   ("ready",)  ("loaded", key, error)  ("token", rid, id, logprob, top)
                      ("done", rid, result, error)  ("stats", counters)  ("pong", stamp)

The engine loads a model version from its folder (`LoadedModel.folder`) on `serve.device` the first time it is
named (ModelHolder.before_swap names a new one before the swap), and keeps the versions rows are decoded with plus
the latest ones. It exits when the server's end of the pipe closes (the server stopped or was killed).

Never deaf (issue #47). Each loop of the engine (its inbox, its worker, its reporter) survives a failing message
or job: that request fails with the reason, the loop goes on. The worker tells the inbox thread which models its
rows use by a message (`Worker.on_models`), never through a dict it mutates. On the server's side nothing blocks
the event loop on a pipe: messages go through a bounded queue to a sender thread (a full pipe fills the queue,
and a request that finds it full is refused, 503); every pending request has a deadline
(serve.request_timeout_s); a watchdog thread pings the engine every serve.engine_heartbeat_s, and an engine that
died, or answered nothing for serve.engine_timeout_s (a model load aside), is killed and replaced off the event
loop, its models loaded again; meanwhile requests are refused with 503 and Retry-After, and those it held fail so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from lopd_core.rollout.scoring import SequenceScores
from lopd_serve.batching import Generated, Job, Ping, ScoreJob, SeedStream, Unavailable, Worker, within, worker_future
from lopd_serve.models import load_checkpoint

log = logging.getLogger("lopd.serve")
MODELS_KEPT = 2  # versions the engine keeps loaded beyond those rows are decoded with
STATS_EVERY_S = 0.2  # how often the engine reports its counters (health, the benchmark)
START_TIMEOUT_S = 300.0  # an engine that is not running (torch imported, its models loaded) by then failed to start
OUTGOING_BOUND = 4096  # messages waiting for the sender thread: beyond, the engine is not reading (503)


@dataclass
class _Load:
    """A model the server asked an engine to load: set once it answered (`error` None: loaded)."""

    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass(eq=False)
class _Link:
    """One engine child, the server's ends of its two pipes, and what the threads serving them share."""

    child: multiprocessing.Process
    inbox: object  # server -> engine (written by the sender thread only)
    outbox: object  # engine -> server (read by the reader thread only)
    outgoing: queue.Queue = field(default_factory=lambda: queue.Queue(OUTGOING_BOUND))
    loads: dict[str, _Load] = field(default_factory=dict)  # model key -> its load in this engine
    heard: float = field(default_factory=time.monotonic)  # when the engine last said anything

    def post(self, message: tuple) -> None:
        """Queue a message for the engine without ever blocking; Unavailable when the engine is not reading."""
        try:
            self.outgoing.put_nowait(message)
        except queue.Full:
            raise Unavailable("the engine process is not reading its messages (its pipe is full)") from None


class EngineProcess:
    """The decoder's API as Batcher's (generate, score, draw_seed, counters), served by a child process."""

    def __init__(
        self,
        *,
        window_s: float,
        max_batch: int,
        seed: int = 0,
        device: str = "auto",
        timeout_s: float = 300.0,
        heartbeat_s: float = 1.0,
        engine_timeout_s: float = 30.0,
    ):
        self.window_s, self.max_batch, self.device = window_s, max_batch, device
        self.timeout_s, self.heartbeat_s, self.engine_timeout_s = timeout_s, heartbeat_s, engine_timeout_s
        self.seeds = SeedStream(seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # _pending, _link and _models: the event loop, the reader and the watchdog
        self._pending: dict[int, tuple] = {}  # rid -> (deliver, on_token)
        self._models: OrderedDict[str, tuple] = OrderedDict()  # key -> its load message: what a new engine loads
        self._link: _Link | None = None  # None while no engine runs (not started, or being replaced)
        self._wake = threading.Event()  # the reader heard its engine go: the watchdog looks now
        self._stopping = False
        self.restarts = 0
        self.batches = self.rows = self.tokens = 0
        self.busy_s = self.cpu_s = 0.0

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine and wait until it runs (it imports torch and transformers: seconds)."""
        self._link = self._spawn()
        threading.Thread(target=self._watch, name="lopd-serve-engine-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        link = self._link
        if link is None:
            return
        with contextlib.suppress(Unavailable):
            link.post(("stop",))
        link.child.join(timeout=30)
        if link.child.is_alive():
            link.child.kill()
        self._close(link)

    def draw_seed(self) -> int:
        return self.seeds.draw()

    @property
    def ready(self) -> bool:
        """False while the engine is being replaced."""
        return self._link is not None

    def check_available(self) -> None:
        """Unavailable (503, retry later) while the engine is being replaced."""
        self._current()

    def prepare(self, loaded) -> None:
        """Have the engine load `loaded` now and wait for it (blocking: run off the event loop). A new engine
        started later loads it too (it is among the latest)."""
        with self._lock:
            self._models[loaded.version] = ("load", loaded.version, loaded.folder, loaded.version, loaded.name)
            while len(self._models) > MODELS_KEPT + 1:
                self._models.popitem(last=False)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            link = self._link
            if link is None:  # being replaced: the new engine loads it with the others
                time.sleep(0.05)
                continue
            load = self._load(link, loaded)
            if load.done.wait(timeout=max(deadline - time.monotonic(), 0.0)) and load.error is None:
                return
            if link is self._link and load.done.is_set():
                raise RuntimeError(f"the engine process could not load {loaded.version}: {load.error}")
        raise Unavailable(f"the engine process did not load {loaded.version} within {START_TIMEOUT_S:g}s")

    # ---- requests --------------------------------------------------------------------------------------
    async def generate(self, loaded, context: list[int], *, on_token=None, **sampling) -> Generated:
        """Decode one turn (sampling: temperature, top_p, max_tokens, seed, top_logprobs); `on_token(id,
        logprob, top)` runs in this process's reader thread for each kept token. DeadlineExceeded past
        `timeout_s`, Unavailable while the engine is replaced."""
        link = self._current()
        rid, future = self._expect(link, on_token)
        message = ("generate", rid, self._key(link, loaded), list(context), sampling, on_token is not None)
        self._post(link, rid, message)
        try:
            return await within(future, self.timeout_s)
        except BaseException:  # cancelled (its client went away) or past its deadline: its row leaves its batch
            if self._forget(rid):
                with contextlib.suppress(Unavailable):
                    link.post(("cancel", rid))
            raise

    async def score(self, loaded, ids: list[int], *, top_k: int) -> SequenceScores:
        link = self._current()
        rid, future = self._expect(link, None)
        self._post(link, rid, ("score", rid, self._key(link, loaded), list(ids), top_k))
        try:
            return await within(future, self.timeout_s)
        finally:
            self._forget(rid)

    def _current(self) -> _Link:
        link = self._link
        if link is None:
            retry = max(self.heartbeat_s, 1.0)
            raise Unavailable("the engine process is restarting; retry shortly", retry_after_s=retry)
        return link

    def _expect(self, link: _Link, on_token):
        """A pending request on `link`'s engine (Unavailable if it was replaced meanwhile)."""
        rid = next(self._ids)
        future, deliver = worker_future()
        with self._lock:
            if self._link is not link:
                raise Unavailable("the engine process is restarting; retry shortly")
            self._pending[rid] = (deliver, on_token)
        return rid, future

    def _forget(self, rid: int) -> bool:
        with self._lock:
            return self._pending.pop(rid, None) is not None

    def _post(self, link: _Link, rid: int, message: tuple) -> None:
        try:
            link.post(message)
        except Unavailable:
            self._forget(rid)
            raise

    def _key(self, link: _Link, loaded) -> str:
        """The engine's name for a model (its version); asks the engine to load it the first time (the load is
        ahead of the request on the pipe)."""
        self._load(link, loaded)
        return loaded.version

    def _load(self, link: _Link, loaded) -> _Load:
        with self._lock:
            load = link.loads.get(loaded.version)
            if load is None:
                load = link.loads[loaded.version] = _Load()
                link.post(("load", loaded.version, loaded.folder, loaded.version, loaded.name))
        return load

    # ---- starting, watching and replacing the engine ---------------------------------------------------
    def _spawn(self) -> _Link:
        """A new engine child, running, with the threads that serve its pipes (blocking: seconds)."""
        context = multiprocessing.get_context("spawn")
        inbox_read, inbox_write = context.Pipe(duplex=False)
        outbox_read, outbox_write = context.Pipe(duplex=False)
        child = context.Process(
            target=engine_main,
            args=(inbox_read, outbox_write),
            kwargs={"window_s": self.window_s, "max_batch": self.max_batch, "device": self.device},
            name="lopd-serve-engine",
            daemon=True,
        )
        child.start()
        inbox_read.close()
        outbox_write.close()
        link = _Link(child, inbox_write, outbox_read)
        if not outbox_read.poll(START_TIMEOUT_S) or outbox_read.recv() != ("ready",):
            child.kill()
            self._close(link)
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:g}s")
        link.heard = time.monotonic()
        threading.Thread(target=self._write, args=(link,), name="lopd-serve-engine-sender", daemon=True).start()
        threading.Thread(target=self._read, args=(link,), name="lopd-serve-engine-reader", daemon=True).start()
        return link

    def _watch(self) -> None:
        """The watchdog: pings the engine; one that died or stopped answering is replaced (here, off the event
        loop). Its own failures are logged and it goes on (the next look tries again)."""
        while not self._stopping:
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._stopping:
                return
            try:
                link = self._link
                if link is None:
                    self._replace(None, "the last start failed")
                elif not self._healthy(link):
                    self._replace(link, "it died" if not link.child.is_alive() else "it stopped answering")
            except Exception:
                log.exception("the engine watchdog failed; it looks again in %gs", self.heartbeat_s)

    def _healthy(self, link: _Link) -> bool:
        if not link.child.is_alive():
            return False
        with contextlib.suppress(Unavailable):  # a full pipe: the silence below tells
            link.post(("ping", time.monotonic()))
        with self._lock:  # a load holds the engine's inbox for seconds: only death counts meanwhile
            loading = any(not load.done.is_set() for load in link.loads.values())
        return loading or time.monotonic() - link.heard < self.engine_timeout_s

    def _replace(self, link: _Link | None, why: str) -> _Link:
        """Kill `link`'s engine, fail what it held (503: retry), start a new one with the latest models loaded."""
        with self._lock:
            self._link = None
            pending, self._pending = self._pending, {}
            models = list(self._models.values())
        log.warning("the engine process is replaced (%s); %d requests in flight failed", why, len(pending))
        for deliver, _ in pending.values():
            deliver(None, Unavailable(f"the engine process was replaced ({why}); retry"))
        if link is not None:
            link.child.kill()
            link.child.join(timeout=10)
            self._close(link)
        new = self._spawn()
        for message in models:
            new.loads[message[1]] = _Load()
            new.post(message)
        for load in list(new.loads.values()):
            load.done.wait(timeout=START_TIMEOUT_S)
        self.restarts += 1
        with self._lock:
            self._link = new
        if self._stopping:  # stopped meanwhile: this engine goes too
            self.stop()
        return new

    def _close(self, link: _Link) -> None:
        with self._lock:
            loads = list(link.loads.values())
        for load in loads:  # whoever waits for a load in a gone engine hears so
            load.error = load.error or "the engine process stopped"
            load.done.set()
        with contextlib.suppress(queue.Full):
            link.outgoing.put_nowait(None)  # the sender thread ends (if blocked on the pipe, closing ends it)
        for end in (link.inbox, link.outbox):
            with contextlib.suppress(OSError):
                end.close()

    # ---- the sender and reader threads of one engine ---------------------------------------------------
    def _write(self, link: _Link) -> None:
        """Write queued messages to the engine; blocks on a full pipe here, never on the event loop."""
        while (message := link.outgoing.get()) is not None:
            try:
                link.inbox.send(message)
            except (OSError, EOFError, ValueError):  # the engine's end closed: the watchdog replaces it
                self._wake.set()
                return
            except Exception as exc:  # noqa: BLE001  a message that cannot be sent fails its own request
                log.warning("a message could not be sent to the engine: %s: %s", type(exc).__name__, exc)
                if message[0] in ("generate", "score"):
                    self._deliver(message[1], None, RuntimeError(f"the request could not reach the engine: {exc}"))

    def _read(self, link: _Link) -> None:
        """What the engine answers. A message that cannot be handled is logged; the thread goes on."""
        while True:
            try:
                message = link.outbox.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that cannot be unpickled
                log.exception("a message from the engine could not be read")
                continue
            link.heard = time.monotonic()
            try:
                self._heard(link, message)
            except Exception:
                log.exception("a message from the engine could not be handled: %r", message[:2])
        if not self._stopping:
            self._wake.set()  # the engine's end closed: the watchdog replaces it now

    def _heard(self, link: _Link, message: tuple) -> None:
        kind = message[0]
        if kind == "token":
            _, rid, token_id, logprob, top = message
            with self._lock:
                entry = self._pending.get(rid)
            if entry is not None and entry[1] is not None:
                entry[1](token_id, logprob, top)
        elif kind == "done":
            self._deliver(message[1], message[2], message[3])
        elif kind == "loaded":
            _, key, error = message
            with self._lock:
                load = link.loads.setdefault(key, _Load())
            load.error = error
            load.done.set()
        elif kind == "stats":
            (self.batches, self.rows, self.tokens, self.busy_s, self.cpu_s) = message[1]

    def _deliver(self, rid: int, result, error) -> None:
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[0](result, error)


# ---- the engine process ------------------------------------------------------------------------------------
def engine_main(inbox, outbox, *, window_s: float, max_batch: int, device: str) -> None:
    """The child's main: the worker decodes in this thread; a reader thread turns messages into jobs; a reporter
    sends the counters. Exits when the server's end of the inbox closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops its engine
    in_use: queue.Queue = queue.Queue()  # the worker's messages: the models its rows use
    worker = Worker(window_s=window_s, max_batch=max_batch, on_models=in_use.put)
    send = _Sender(outbox)
    state = _Inbox(in_use=in_use)
    threading.Thread(target=serve_inbox, args=(inbox, worker, send, device, state), daemon=True).start()
    threading.Thread(target=report, args=(worker, send), daemon=True).start()
    send(("ready",))
    worker.run()


class _Sender:
    """One message at a time on the outbox (the worker, the reader and the reporter all send)."""

    def __init__(self, outbox):
        self.outbox, self.lock = outbox, threading.Lock()

    def __call__(self, message: tuple) -> None:
        with contextlib.suppress(OSError, ValueError), self.lock:  # the server gone: the inbox's end says so
            self.outbox.send(message)


def report(worker: Worker, send, *, every_s: float = STATS_EVERY_S, rounds: int | None = None) -> None:
    """The reporter loop: the worker's counters when they change. A failing report is logged; the loop goes on."""
    last = None
    for _ in itertools.count() if rounds is None else range(rounds):
        time.sleep(every_s)
        try:
            counters = tuple(getattr(worker, name) for name in Worker.COUNTERS)
            if counters != last:
                send(("stats", counters))
                last = counters
        except Exception:
            log.exception("the engine's counters could not be reported")


@dataclass
class _Inbox:
    """What the inbox thread alone reads and writes: the models loaded, the generate jobs it may cancel, and the
    worker's latest word on the models its rows use."""

    in_use: queue.Queue
    models: OrderedDict = field(default_factory=OrderedDict)
    jobs: dict = field(default_factory=dict)
    using: tuple = ()

    def heard_worker(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.using = self.in_use.get_nowait()


def serve_inbox(inbox, worker: Worker, send, device: str, state: _Inbox) -> None:
    """The inbox loop: each message from the server handled in turn. A message that fails fails its own request
    (the server hears why) and the loop goes on: a thread that died here would leave a live engine deaf."""
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the server stopped or died: so does its engine
            os._exit(0)
        except Exception:  # a message that cannot be unpickled: nobody to answer
            log.exception("a message to the engine could not be read")
            continue
        if isinstance(message, tuple) and message[:1] == ("stop",):
            worker.submit(None)
            return
        try:
            state.heard_worker()
            _handle(message, state, worker, send, device)
        except Exception as exc:
            log.exception("the engine could not handle a message")
            _refuse(message, send, exc)


def _handle(message: tuple, state: _Inbox, worker: Worker, send, device: str) -> None:
    kind = message[0]
    if kind == "load":
        _load(state, message, send, device)
    elif kind == "cancel":
        job = state.jobs.pop(message[1], None)
        if job is not None:
            job.gone = True
    elif kind == "ping":
        stamp = message[1]
        worker.submit(Ping(lambda: send(("pong", stamp))))  # answered by the worker's loop: both are alive
    elif kind in ("generate", "score"):
        _submit(message, state, worker, send)
    else:
        raise ValueError(f"unknown message {kind!r}")


def _refuse(message, send, exc: Exception) -> None:
    """The failed message's request fails with the reason (a load: its waiters hear it)."""
    kind = message[0] if isinstance(message, tuple) and message else None
    error = f"the engine could not take this {kind or 'message'}: {type(exc).__name__}: {exc}"
    if kind in ("generate", "score") and len(message) > 1:
        send(("done", message[1], None, RuntimeError(error)))
    elif kind == "load" and len(message) > 1:
        send(("loaded", message[1], error))


def _load(state: _Inbox, message: tuple, send, device: str) -> None:
    _, key, folder, version, name = message
    models = state.models
    try:
        models[key] = load_checkpoint(folder, version=version, name=name, device=device)
    except Exception as exc:  # noqa: BLE001  the server hears why; requests naming it fail
        send(("loaded", key, f"{type(exc).__name__}: {exc}"))
        return
    used = {id(m) for m in state.using}
    for old in [k for k in models if k != key][: max(len(models) - 1 - MODELS_KEPT, 0)]:
        if id(models[old]) not in used:
            del models[old]
    send(("loaded", key, None))


def _submit(message: tuple, state: _Inbox, worker: Worker, send) -> None:
    rid, key = message[1], message[2]
    jobs = state.jobs

    def deliver(result, exc) -> None:  # in the worker's thread
        jobs.pop(rid, None)
        send(("done", rid, result, _portable(exc)))

    loaded = state.models.get(key)
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

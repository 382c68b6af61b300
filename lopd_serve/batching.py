"""Concurrent requests decoded together over the model, off the event loop: a continuous batch
(lopd_core/rollout/continuous.py) in one worker.

Why: one request at a time would leave the batched, KV-cached decoding idle while requests queue, and a fixed
batch (decode until its last row is done, then take the next) makes a request that arrives meanwhile wait for the
whole batch while the rows already done wait for their answer. Here a request joins the running batch at the next
step and leaves it, answered, the step it finishes; the event loop only awaits a future, so a long generation
never blocks other requests, health checks or feedback. When the worker is idle, the first request waits
`window_s` for others to join its first step (their prefills are then one forward).

Rows are grouped by the `LoadedModel` they were rendered for (across a hot swap, the old and the new version are
decoded apart, each in its own batch, stepped in turn), at most `max_batch` rows per batch (the rest wait their
turn). Every row samples from its own CPU stream seeded by the request's `seed` (or one drawn from the server's
seeded stream) with its own temperature and top-p, so a seeded request samples the same tokens whatever shares
its batch (up to float noise in batched logits).

Each kept token is handed to its request's `on_token` as soon as it is sampled (how a stream sends it), with
the top-k log-probs of the distribution it was drawn from when the request asked for them. Scoring requests
(prompt log-probs) run in the same worker between steps, so they never race a decode for the device.

A request whose client went away (its task cancelled: a stream closed) leaves its batch before the next step.
A step that fails (a context the model cannot read) is traced to its request by running each row's sequence
alone (`probe`): only the request that fails fails, and its batch mates go on from the tokens they kept, their
streams where they were (the cache is rebuilt from their ids). No failure ends the loop: a job that cannot be
admitted (a seed out of range, a model that cannot batch) fails alone, a batch that can neither step nor be
rebuilt fails its rows, and a `deliver` that raises is logged; a decoder whose loop died would leave every later
request waiting for ever.

Every request has a deadline (`timeout_s`, serve.request_timeout_s): past it, it leaves its batch and its caller
hears `DeadlineExceeded`, never an unbounded wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lopd_core.rollout.constrained import Constrained
from lopd_core.rollout.continuous import ContinuousBatch, Request, probe
from lopd_core.rollout.scoring import SequenceScores, score_sequence
from lopd_core.rollout.turn_grammar import OutputConstraint
from lopd_serve.logprobs import finite

log = logging.getLogger("lopd.serve")


class Unavailable(RuntimeError):
    """The decoder cannot take a request now (its engine restarting, its pipe full): 503, retry after
    `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(TimeoutError):
    """A request not answered within its deadline (serve.request_timeout_s): it left its batch."""


@dataclass(eq=False)  # a job is itself, never equal to another with the same fields
class Job:
    loaded: object  # the LoadedModel the context was rendered for
    context: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    deliver: Callable[[object, Exception | None], None]  # called once, in the worker: (Generated, None) or (None, exc)
    top_logprobs: int = 0
    on_token: Callable[[int, float, list], None] | None = None  # called in the worker per kept token
    stop: tuple[str, ...] = ()  # stop strings (OpenAI's `stop`): the first the text holds ends the turn
    constraint: OutputConstraint | None = None  # what the turn must be (a JSON answer, a tool call): masked decoding
    gone: bool = False  # its request was cancelled (the client went away): it leaves its batch
    watch: StopStrings | None = None  # set by the worker when it admits a job with stop strings


@dataclass
class StopStrings:
    """A row's watch for its stop strings: fed each kept token, `hit` is the first stop string the decoded text
    holds (it appears the step its last character is sampled). Only a tail of the ids is decoded each step:
    a character is at most 4 byte-level tokens, so 4 tokens per character of the longest stop string (and 4
    more for a character cut at the tail's start) always hold a stop string that just appeared."""

    tokenizer: object
    strings: tuple[str, ...]
    end_id: int  # the end-of-turn token: it ends the turn itself and is no text
    ids: list[int] = field(default_factory=list)
    hit: str | None = None

    def add(self, token_id: int) -> None:
        if self.hit is not None or token_id == self.end_id:
            return
        self.ids.append(token_id)
        tail = self.ids[-4 * max(map(len, self.strings)) - 4 :]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        self.hit = next((s for s in self.strings if s in text), None)


@dataclass(eq=False)
class ScoreJob:
    loaded: object
    ids: list[int]
    top_k: int
    deliver: Callable[[object, Exception | None], None]


@dataclass(eq=False)
class Ping:
    """A heartbeat: `answer` is called by the worker's loop between steps (the engine process's watchdog hears that
    the loop still turns)."""

    answer: Callable[[], None]


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # closed its turn with the end token (else it ran out of max_tokens, or hit a stop string)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: top-k (id, logprob) or []
    stop_string: str | None = None  # the stop string that ended the turn (its last token is the last sampled)


class Batcher:
    """The decoder on a thread of the server's process: the worker below, fed from the event loop. (The engine
    process, engine_process.py, runs the same worker in a process of its own.)"""

    def __init__(self, *, window_s: float, max_batch: int, seed: int = 0, timeout_s: float = 300.0):
        self.worker = Worker(window_s=window_s, max_batch=max_batch)
        self.seeds = SeedStream(seed)
        self.timeout_s = timeout_s
        self._thread = threading.Thread(target=self.worker.run, name="lopd-serve-batcher", daemon=True)

    # the worker's counters (health and the benchmark read them; the engine process reports its own)
    batches = property(lambda self: self.worker.batches)
    rows = property(lambda self: self.worker.rows)
    tokens = property(lambda self: self.worker.tokens)
    busy_s = property(lambda self: self.worker.busy_s)
    cpu_s = property(lambda self: self.worker.cpu_s)
    restarts, ready = 0, True  # a thread of this process: never replaced

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.worker.submit(None)
        self._thread.join(timeout=30)

    def draw_seed(self) -> int:
        return self.seeds.draw()

    def prepare(self, loaded) -> None:
        """Nothing to load: the worker decodes with the LoadedModel each job names."""

    def check_available(self) -> None:
        """Always: the worker is a thread of this process (its loop survives every failing job)."""

    async def generate(self, loaded, context: list[int], *, on_token=None, **sampling) -> Generated:
        """Decode one turn (sampling: temperature, top_p, max_tokens, seed, top_logprobs); `on_token(id,
        logprob, top)` runs in the worker thread for each kept token."""
        future, deliver = worker_future()
        job = Job(loaded, context, deliver=deliver, on_token=on_token, **sampling)
        self.worker.submit(job)
        try:
            return await within(future, self.timeout_s)
        except (asyncio.CancelledError, DeadlineExceeded):
            job.gone = True  # read by the worker before its next step: the row leaves the batch
            raise

    async def score(self, loaded, ids: list[int], *, top_k: int) -> SequenceScores:
        future, deliver = worker_future()
        self.worker.submit(ScoreJob(loaded, ids, top_k, deliver))
        return await within(future, self.timeout_s)


async def within(future: asyncio.Future, timeout_s: float):
    """`future`'s result, or DeadlineExceeded once `timeout_s` has passed (the future is cancelled)."""
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(f"not answered within {timeout_s:g}s (serve.request_timeout_s)") from None


class SeedStream:
    """The server's seeded stream of per-request seeds (a request that names none gets the next)."""

    def __init__(self, seed: int):
        self._seeds = random.Random(seed)
        self._lock = threading.Lock()

    def draw(self) -> int:
        with self._lock:
            return self._seeds.randrange(2**63)


def worker_future():
    """A future of the running loop and a `deliver(result, exc)` that settles it from any thread."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(result, exc) -> None:
        with contextlib.suppress(RuntimeError):  # a loop already closed has nobody waiting
            loop.call_soon_threadsafe(_settle, future, result, exc)

    return future, deliver


class Worker:
    """The decoding loop: jobs in (`submit`, from any thread), continuous batches stepped, results handed to
    each job's `deliver`. Runs on a thread (Batcher) or as the main loop of the engine process."""

    COUNTERS = ("batches", "rows", "tokens", "busy_s", "cpu_s")

    def __init__(self, *, window_s: float, max_batch: int, on_models: Callable[[tuple], None] | None = None):
        self.window_s = window_s
        self.max_batch = max_batch
        # called in the worker's thread with the LoadedModels rows are decoded with, each time that set changes:
        # how the engine process hears what it must keep loaded (a message, never a read of this loop's dict)
        self.on_models = on_models
        self._reported: tuple = ()
        self._queue: queue.Queue[Job | ScoreJob | Ping | None] = queue.Queue()
        self._running: dict[int, tuple[object, ContinuousBatch]] = {}  # id(LoadedModel) -> (it, its batch)
        self._jobs: dict[int, Job] = {}  # id(Request) -> its job
        self._waiting: list[Job] = []  # admitted when their model's batch has room
        self.batches = 0  # decoding steps run, each one forward over the rows present (the benchmark reads it)
        self.rows = 0  # requests decoded
        self.tokens = 0  # tokens kept for requests (a row that left stops adding to it)
        self.busy_s = 0.0  # wall time the worker spent decoding or scoring (the benchmark reads it)
        self.cpu_s = 0.0  # CPU time of the worker thread meanwhile: busy minus this is time it waited for the GIL

    def submit(self, job: Job | ScoreJob | Ping | None) -> None:
        """Queue a job; None stops the loop (every job still waiting fails)."""
        self._queue.put(job)

    def run(self) -> None:
        """Step every running batch until stopped. A failure is a job's or a batch's, never the loop's."""
        while True:
            arrived = self._take(wait=not self._running and not self._waiting)
            if arrived is None:  # stopped (whoever still waited heard so)
                return
            wall, cpu = time.perf_counter(), time.thread_time()
            for job in [*self._waiting, *arrived]:
                try:
                    self._admit(job)
                except Exception as exc:  # noqa: BLE001  this job's own failure: it fails alone
                    self._drop([job], exc)
            for key, (loaded, batch) in list(self._running.items()):
                try:
                    self._step(loaded, batch)
                except Exception as exc:  # noqa: BLE001  the batch could neither step nor be rebuilt: its rows fail
                    self._drop([self._jobs[id(r)] for r in batch.requests() if id(r) in self._jobs], exc)
                    batch = None
                if not batch:
                    del self._running[key]
            self._report_models()
            self.busy_s += time.perf_counter() - wall
            self.cpu_s += time.thread_time() - cpu

    def _drop(self, jobs: list[Job], exc: Exception) -> None:
        log.warning("the decoder dropped %d request(s): %s: %s", len(jobs), type(exc).__name__, exc)
        self._waiting = [j for j in self._waiting if j not in jobs]
        self._jobs = {k: j for k, j in self._jobs.items() if j not in jobs}
        for job in jobs:
            _hand(job, None, exc)

    def _report_models(self) -> None:
        models = tuple(loaded for loaded, _ in self._running.values())
        if self.on_models is not None and [id(m) for m in models] != [id(m) for m in self._reported]:
            self._reported = models
            self.on_models(models)

    def _take(self, *, wait: bool) -> list[Job] | None:
        """What arrived since the last step (scoring run at once); None once stopped. An idle worker waits for a
        first request, then `window_s` for others to join it."""
        arrived: list[Job] = []
        deadline = None
        while True:
            try:
                if wait and not arrived:
                    job = self._queue.get()
                    deadline = time.perf_counter() + self.window_s
                elif deadline is not None and time.perf_counter() < deadline:
                    job = self._queue.get(timeout=max(deadline - time.perf_counter(), 0.0))
                else:
                    job = self._queue.get_nowait()
            except queue.Empty:
                return arrived
            if job is None:
                self._fail_all(RuntimeError("the server stopped"), arrived=arrived)
                return None
            if isinstance(job, ScoreJob):
                self._score(job)
            elif isinstance(job, Ping):
                _hand_ping(job)
            else:
                arrived.append(job)

    def _fail_all(self, exc: Exception, *, arrived: list[Job]) -> None:
        jobs = [*arrived, *self._waiting, *self._jobs.values()]
        self._waiting, self._jobs, self._running = [], {}, {}
        for job in jobs:
            _hand(job, None, exc)

    def _admit(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
        if job.gone:
            return
        if id(job.loaded) not in self._running:
            chat = job.loaded.chat
            batch = ContinuousBatch(job.loaded.model, stop_id=chat.im_end_id, pad_id=chat.pad_id)
            self._running[id(job.loaded)] = (job.loaded, batch)
        batch = self._running[id(job.loaded)][1]
        if len(batch) >= self.max_batch:
            self._waiting.append(job)
            return
        if job.stop:
            job.watch = StopStrings(job.loaded.tokenizer, job.stop, job.loaded.chat.im_end_id)
        constrained = None
        if job.constraint is not None:  # the masks of the valid tokens, step by step (built here, like the watch)
            constrained = Constrained(job.constraint, job.loaded.tokenizer, job.loaded.chat.im_end_id)
        request = Request(
            job.context,
            job.temperature,
            job.top_p,
            job.max_tokens,
            torch.Generator().manual_seed(job.seed),
            top_logprobs=job.top_logprobs,
            on_token=self._on_token(job),
            constraint=constrained,
        )
        self._jobs[id(request)] = job
        batch.add(request)
        self.rows += 1

    def _on_token(self, job: Job):
        def kept(token_id: int, logprob: float, top: list) -> None:
            self.tokens += 1
            if job.watch is not None:
                job.watch.add(token_id)
            if job.on_token is not None:
                job.on_token(token_id, logprob, top)

        return kept

    def _step(self, loaded, batch: ContinuousBatch) -> None:
        """One step of a model's batch: the rows whose client left go first; a failing step fails only the
        requests that fail alone."""
        gone = [r for r in batch.requests() if self._jobs[id(r)].gone]
        if gone:
            batch.remove(gone)
            for request in gone:
                del self._jobs[id(request)]
        if not batch:
            return
        try:
            done = batch.step()
        except Exception as exc:  # noqa: BLE001  handed to the waiting requests, never kills the worker
            self._isolate(loaded, batch, exc)
            return
        self.batches += 1
        ended = [r for r in batch.requests() if (w := self._jobs[id(r)].watch) is not None and w.hit is not None]
        batch.remove(ended)  # a stop string ends its row's turn as the end token would
        for request in [*done, *ended]:
            self._finish(request, loaded.chat.im_end_id)

    def _isolate(self, loaded, batch: ContinuousBatch, exc: Exception) -> None:
        """Run each row's sequence alone: the requests that fail alone fail; the others go on from their ids in a
        rebuilt cache. When none fails alone, the failure is the batch's: every row fails with it."""
        failed: list[tuple[Request, Exception]] = []
        for request in batch.requests():
            try:
                probe(loaded.model, request)
            except Exception as alone:  # noqa: BLE001
                failed.append((request, alone))
        failed = failed or [(request, exc) for request in batch.requests()]
        batch.remove([request for request, _ in failed])
        # Answered before the rebuild: a rebuild that raises fails the rows still in the batch (the caller's
        # guard), and these rows, already out of it, would otherwise wait for their deadline.
        for request, error in failed:
            _hand(self._jobs.pop(id(request)), None, error)
        batch.rebuild()

    def _finish(self, request: Request, end_id: int) -> None:
        job = self._jobs.pop(id(request))
        stopped = bool(request.ids) and request.ids[-1] == end_id
        hit = job.watch.hit if job.watch is not None and not stopped else None
        logprobs = [finite(float(v)) for v in request.logprobs]
        _hand(job, Generated(list(request.ids), logprobs, stopped, request.top, stop_string=hit), None)

    def _score(self, job: ScoreJob) -> None:
        try:
            out = score_sequence(job.loaded.model, job.ids, top_k=job.top_k)
        except Exception as exc:  # noqa: BLE001  handed to the waiting request, never kills the worker
            _hand(job, None, exc)
            return
        _hand(job, out, None)


def _hand(job: Job | ScoreJob, result, exc) -> None:
    """Hand a job its answer; a `deliver` that raises (its pipe gone, a result that cannot be pickled) is logged:
    the loop goes on."""
    try:
        job.deliver(result, exc)
    except Exception:
        log.exception("a decoder result could not be handed over")


def _hand_ping(ping: Ping) -> None:
    try:
        ping.answer()
    except Exception:
        log.exception("a heartbeat could not be answered")


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the request was cancelled (its client went away)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

"""Concurrent requests batched over the rollout engine's decoder, off the event loop.

Why: one request at a time would leave the batched, KV-cached decoding of the rollout engine
(lopd_core/rollout/decode.py, `generate_turn`) idle while requests queue. One worker thread takes the first
waiting request, waits `window_s` for others to join (up to `max_batch`), and decodes them together; the event
loop only awaits a future, so a long generation never blocks other requests, health checks or feedback.

A batch shares what `generate_turn` shares: the model and the sampling settings. Requests are grouped by the
`LoadedModel` they were rendered for (across a hot swap, the old and the new version are decoded apart) and by
(temperature, top_p); a group decodes up to its largest `max_tokens`, and each row is cut at its own: the tokens
kept are exactly what was sampled, with their log-probs. Every row samples from its own CPU stream seeded by the
request's `seed` (or one drawn from the server's seeded stream), so a seeded request samples the same tokens
whatever shares its batch (up to float noise in batched logits).

Each kept token is handed to its request's `on_token` as soon as it is sampled (how a stream sends it), with
the top-k log-probs of the distribution it was drawn from when the request asked for them. Scoring requests
(prompt log-probs) run in the same thread, one sequence per forward, so they never race a decode for the device.

A request whose client went away (its task cancelled: a stream closed) leaves its batch at the next token, and
a batch that fails (a context the model cannot read) is decoded again row by row, so only the failing request
fails: in both cases the other rows go on from the tokens they kept, their seeded streams replayed to the same
point (`_Row`), so what they sample does not depend on the event.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lopd_core.rollout.decode import generate_turn
from lopd_core.rollout.scoring import SequenceScores, score_sequence
from lopd_core.rollout.trajectory import Sampling
from lopd_serve.logprobs import finite


@dataclass
class Job:
    loaded: object  # the LoadedModel the context was rendered for
    context: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    top_logprobs: int = 0
    on_token: Callable[[int, float, list], None] | None = None  # called in the worker thread per kept token
    gone: bool = False  # its request was cancelled (the client went away): it leaves its batch
    queued: float = field(default_factory=time.perf_counter)


@dataclass
class ScoreJob:
    loaded: object
    ids: list[int]
    top_k: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # closed its turn with the end token (else it ran out of max_tokens)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: top-k (id, logprob) or []


class Batcher:
    def __init__(self, *, window_s: float, max_batch: int, seed: int = 0):
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: queue.Queue[Job | ScoreJob | None] = queue.Queue()
        self._seeds = random.Random(seed)
        self._seed_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lopd-serve-batcher", daemon=True)
        self.batches = 0  # how many decoding batches ran (the benchmark reads it)
        self.rows = 0
        self.tokens = 0  # tokens kept for requests (a row that left stops adding to it)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def draw_seed(self) -> int:
        with self._seed_lock:
            return self._seeds.randrange(2**63)

    async def generate(
        self,
        loaded,
        context: list[int],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int,
        top_logprobs: int = 0,
        on_token=None,
    ) -> Generated:
        """Decode one turn; `on_token(id, logprob, top)` runs in the worker thread for each kept token."""
        loop = asyncio.get_running_loop()
        job = Job(
            loaded,
            context,
            temperature,
            top_p,
            max_tokens,
            seed,
            loop,
            loop.create_future(),
            top_logprobs=top_logprobs,
            on_token=on_token,
        )
        self._queue.put(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.gone = True  # read by the worker thread at its next token: the row leaves the batch
            raise

    async def score(self, loaded, ids: list[int], *, top_k: int) -> SequenceScores:
        loop = asyncio.get_running_loop()
        job = ScoreJob(loaded, ids, top_k, loop, loop.create_future())
        self._queue.put(job)
        return await job.future

    # ---- worker thread ---------------------------------------------------------------------------------
    def _collect(self, first: Job) -> list[Job | ScoreJob]:
        jobs = [first]
        deadline = time.perf_counter() + self.window_s
        while len(jobs) < self.max_batch:
            left = deadline - time.perf_counter()
            try:
                job = self._queue.get(timeout=max(left, 0.0)) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # stop after this batch
                break
            jobs.append(job)
        return jobs

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs = self._collect(first)
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                if isinstance(job, ScoreJob):
                    self._score(job)
                    continue
                groups.setdefault((id(job.loaded), job.temperature, job.top_p), []).append(job)
            for group in groups.values():
                self._decode(group)

    def _score(self, job: ScoreJob) -> None:
        try:
            out = score_sequence(job.loaded.model, job.ids, top_k=job.top_k)
        except Exception as exc:  # noqa: BLE001  handed to the waiting request, never kills the worker
            job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
            return
        job.loop.call_soon_threadsafe(_settle, job.future, out, None)

    def _decode(self, group: list[Job]) -> None:
        """Decode a group until every row is settled. Two events stop the batch early and the rows left go on
        from where they are (`_Row.context`, their streams replayed): a client that went away (its row leaves,
        the others do not decode to its max_tokens), and a failure (each row is then decoded alone, so only the
        request that fails fails, not the innocent ones batched with it)."""
        self._decode_group([_Row(job, self) for job in group])

    def _decode_group(self, rows: list[_Row]) -> None:
        end_id = rows[0].job.loaded.chat.im_end_id
        while rows:
            rows = [row for row in rows if not row.job.gone]
            for row in [row for row in rows if row.finished(end_id)]:
                row.settle(end_id)
            rows = [row for row in rows if not row.finished(end_id)]
            if not rows:
                return
            try:
                self._decode_rows(rows)
            except _Left:
                continue
            except Exception as exc:  # noqa: BLE001  handed to the waiting request, never kills the worker
                if len(rows) == 1:
                    rows[0].job.loop.call_soon_threadsafe(_settle, rows[0].job.future, None, exc)
                    return
                for row in rows:
                    self._decode_group([row])
                return

    def _decode_rows(self, rows: list[_Row]) -> None:
        head = rows[0].job
        chat = head.loaded.chat
        sampling = Sampling(
            temperature=head.temperature,
            top_p=head.top_p,
            max_new_tokens=max(row.job.max_tokens - len(row.ids) for row in rows),
        )

        def on_token(n: int, token_id: int, logprob: float, top: list) -> None:
            if any(row.job.gone for row in rows):
                raise _Left  # before this token is kept: the row's stream is replayed up to what it kept
            rows[n].keep(token_id, logprob, top)

        generate_turn(
            head.loaded.model,
            [row.context() for row in rows],
            sampling=sampling,
            stop_id=chat.im_end_id,
            pad_id=chat.pad_id,
            generator=[row.stream() for row in rows],
            on_token=on_token,
            top_logprobs=max(row.job.top_logprobs for row in rows),
        )
        self.batches += 1
        self.rows += len(rows)


class _Left(Exception):
    """A request of the batch was cancelled (its client went away) while the batch decoded."""


class _Row:
    """One request's turn as decoded so far: what a batch that stops early hands on to the next one."""

    def __init__(self, job: Job, batcher: Batcher):
        self.job, self.batcher = job, batcher
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list] = []

    def context(self) -> list[int]:
        return self.job.context + self.ids

    def stream(self) -> torch.Generator:
        """The row's sampling stream where it left off: seeded by the request, advanced one draw per kept token
        (the decoder draws one uniform per sampled token of a row, none when greedy), so a row that goes on in
        another batch samples what it would have sampled in this one."""
        generator = torch.Generator().manual_seed(self.job.seed)
        if self.job.temperature > 0:
            for _ in self.ids:
                torch.rand(1, generator=generator, dtype=torch.float64)
        return generator

    def keep(self, token_id: int, logprob: float, top: list) -> None:
        if len(self.ids) >= self.job.max_tokens:  # decoded for a batch mate's longer max_tokens: not kept
            return
        self.ids.append(token_id)
        self.logprobs.append(finite(float(logprob)))
        self.top.append(top[: self.job.top_logprobs])
        self.batcher.tokens += 1
        if self.job.on_token is not None:
            self.job.on_token(token_id, logprob, self.top[-1])

    def finished(self, end_id: int) -> bool:
        return len(self.ids) >= self.job.max_tokens or bool(self.ids and self.ids[-1] == end_id)

    def settle(self, end_id: int) -> None:
        out = Generated(list(self.ids), list(self.logprobs), bool(self.ids) and self.ids[-1] == end_id, self.top)
        self.job.loop.call_soon_threadsafe(_settle, self.job.future, out, None)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the request was cancelled (its client went away)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

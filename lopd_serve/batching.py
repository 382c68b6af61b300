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
        return await job.future

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
        head = group[0]
        chat = head.loaded.chat
        sampling = Sampling(
            temperature=head.temperature, top_p=head.top_p, max_new_tokens=max(j.max_tokens for j in group)
        )
        tops: list[list] = [[] for _ in group]

        def on_token(row: int, token_id: int, logprob: float, top: list) -> None:
            job = group[row]
            if len(tops[row]) >= job.max_tokens:  # decoded for a batch mate's longer max_tokens: not kept
                return
            tops[row].append(top[: job.top_logprobs])
            if job.on_token is not None:
                job.on_token(token_id, logprob, tops[row][-1])

        try:
            turns = generate_turn(
                head.loaded.model,
                [j.context for j in group],
                sampling=sampling,
                stop_id=chat.im_end_id,
                pad_id=chat.pad_id,
                generator=[torch.Generator().manual_seed(j.seed) for j in group],
                on_token=on_token,
                top_logprobs=max(j.top_logprobs for j in group),
            )
        except Exception as exc:  # noqa: BLE001  handed to every waiting request, never kills the worker
            for job in group:
                job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
            return
        self.batches += 1
        self.rows += len(group)
        for job, (ids, logprobs), top in zip(group, turns, tops):
            ids, logprobs = ids[: job.max_tokens], logprobs[: job.max_tokens]
            out = Generated(
                list(ids), [finite(float(v)) for v in logprobs], bool(ids) and ids[-1] == chat.im_end_id, top
            )
            job.loop.call_soon_threadsafe(_settle, job.future, out, None)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the request was cancelled (its client went away)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

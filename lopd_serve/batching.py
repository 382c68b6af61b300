"""Concurrent requests batched over the rollout engine's decoder, off the event loop.

Why: one request at a time would leave the batched, KV-cached decoding of the rollout engine
(lopd_core/rollout/engine.py, `generate_turn`) idle while requests queue. One worker thread takes the first
waiting request, waits `window_s` for others to join (up to `max_batch`), and decodes them together; the event
loop only awaits a future, so a long generation never blocks other requests, health checks or feedback.

A batch shares what `generate_turn` shares: the model and the sampling settings. Requests are grouped by the
`LoadedModel` they were rendered for (across a hot swap, the old and the new version are decoded apart) and by
(temperature, top_p); a group decodes up to its largest `max_tokens`, and each row is cut at its own: the tokens
kept are exactly what was sampled, with their log-probs. Every row samples from its own CPU stream seeded by the
request's `seed` (or one drawn from the server's seeded stream), so a seeded request samples the same tokens
whatever shares its batch (up to float noise in batched logits).
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from lopd_core.rollout.engine import Sampling, generate_turn


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
    queued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # closed its turn with the end token (else it ran out of max_tokens)


class Batcher:
    def __init__(self, *, window_s: float, max_batch: int, seed: int = 0):
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: queue.Queue[Job | None] = queue.Queue()
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

    async def generate(self, loaded, context: list[int], *, temperature: float, top_p: float, max_tokens: int,
                       seed: int) -> Generated:
        loop = asyncio.get_running_loop()
        job = Job(loaded, context, temperature, top_p, max_tokens, seed, loop, loop.create_future())
        self._queue.put(job)
        return await job.future

    # ---- worker thread ---------------------------------------------------------------------------------
    def _collect(self, first: Job) -> list[Job]:
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
                groups.setdefault((id(job.loaded), job.temperature, job.top_p), []).append(job)
            for group in groups.values():
                self._decode(group)

    def _decode(self, group: list[Job]) -> None:
        head = group[0]
        chat = head.loaded.chat
        sampling = Sampling(temperature=head.temperature, top_p=head.top_p,
                            max_new_tokens=max(j.max_tokens for j in group))
        try:
            turns = generate_turn(head.loaded.model, [j.context for j in group], sampling=sampling,
                                  stop_id=chat.im_end_id, pad_id=chat.pad_id,
                                  generator=[torch.Generator().manual_seed(j.seed) for j in group])
        except Exception as exc:  # noqa: BLE001  handed to every waiting request, never kills the worker
            for job in group:
                job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
            return
        self.batches += 1
        self.rows += len(group)
        for job, (ids, logprobs) in zip(group, turns):
            ids, logprobs = ids[:job.max_tokens], logprobs[:job.max_tokens]
            out = Generated(list(ids), [float(v) for v in logprobs], bool(ids) and ids[-1] == chat.im_end_id)
            job.loop.call_soon_threadsafe(_settle, job.future, out, None)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the request was cancelled (its client went away)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

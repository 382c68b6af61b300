"""Admission control: a bounded queue in front of the decoder, and every wait with a deadline (issue #47).

Why: without a bound, a burst of requests queues in the decoder without end, each waiting longer than the last,
and a client hears nothing until its own timeout; with one, the request that would wait past what the server can
serve is told at once to come back (429 with Retry-After), as vLLM's and OpenAI's servers answer an overload.
At most `serve.max_batch + serve.max_queue` requests are admitted at a time (decoding, waiting for a row, or
waiting for their session's previous turn); the count lives on the event loop, so it needs no lock.

Every admitted request then has a deadline, `serve.request_timeout_s`: for its session's previous turn to end
(a client sending many turns of one session at once) and in the decoder (batching.within). Past it, or while
the engine process is being replaced, the answer is a 503 with Retry-After (`decoder_error`): refused or
answered, never an unbounded wait.
"""

from __future__ import annotations

import asyncio

from lopd_serve.batching import DeadlineExceeded, Unavailable
from lopd_serve.protocol import ApiError

RETRY_AFTER_S = 1.0  # what an overloaded server asks a client to wait before trying again


class Admission:
    """The count of requests admitted to the decoder, bounded by `limit`; `timeout_s` bounds each wait."""

    def __init__(self, *, limit: int, timeout_s: float):
        self.limit, self.timeout_s = limit, timeout_s
        self.active = 0  # admitted and not yet released
        self.refused = 0  # 429s answered (health reports it)

    def enter(self) -> Slot:
        """A slot (release it once done), or a 429 at once when `limit` requests hold one. Event loop only."""
        if self.active >= self.limit:
            self.refused += 1
            raise ApiError(
                429,
                f"the server is at capacity ({self.limit} requests decoding or queued: serve.max_batch + "
                "serve.max_queue); retry shortly",
                "overloaded",
                kind="rate_limit_error",
                retry_after_s=RETRY_AFTER_S,
            )
        self.active += 1
        return Slot(self)

    async def turn(self, lock: asyncio.Lock) -> Slot:
        """A slot and the session's lock (a session answers one turn at a time), the wait for the lock bounded by
        the deadline (503)."""
        slot = self.enter()
        try:
            await asyncio.wait_for(lock.acquire(), self.timeout_s)
        except TimeoutError:
            slot.release()
            raise ApiError(
                503,
                f"the session's previous turn did not end within {self.timeout_s:g}s (serve.request_timeout_s)",
                "deadline_exceeded",
                kind="server_error",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        except BaseException:
            slot.release()
            raise
        slot.lock = lock
        return slot


class Slot:
    """One admitted request: `release` gives back its place (and its session's lock, when it holds one), once."""

    def __init__(self, admission: Admission):
        self.admission, self.lock, self.released = admission, None, False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.admission.active -= 1
        if self.lock is not None:
            self.lock.release()


def decoder_error(exc: Unavailable | DeadlineExceeded) -> ApiError:
    """What the client hears of a decoder that cannot answer: 503 with Retry-After (the engine restarting or not
    reading, or the request past its deadline)."""
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), "engine_unavailable", kind="server_error", retry_after_s=exc.retry_after_s)
    return ApiError(503, str(exc), "deadline_exceeded", kind="server_error", retry_after_s=RETRY_AFTER_S)

"""Two ASGI middlewares in front of every route: a request body's size and arrival time are bounded (BodyLimit),
and a keyless server answers loopback names only (HostAllowList). They run before FastAPI parses anything, so a
refused request costs no parsing, no thread and no model time."""

from __future__ import annotations

import asyncio
import time

from lopd_serve.protocol import error_response


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413 before it is parsed (a declared length or a chunked
    body that outgrows it alike), and one that does not arrive within `timeout_s` with 408: a client sending a
    byte a minute would otherwise hold its connection and its task for ever."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                response = error_response(
                    408, f"the request body did not arrive within {self.timeout_s:g}s (serve.body_timeout_s)", "timeout"
                )
                return await response(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(
            413, f"request body over {self.limit} bytes (serve.max_body_bytes)", "request_too_large"
        )
        await response(scope, receive, send)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class HostAllowList:
    """Refuse (400) a request whose Host header names none of `allowed` (the port aside). DNS rebinding: a web
    page on evil.example re-points its name to 127.0.0.1, and the browser then lets its script talk to a keyless
    loopback server as if it were the page's own, Host still reading evil.example."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {a.lower() for a in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
        name = host[: host.find("]") + 1] if host.startswith("[") else host.split(":", 1)[0]  # the port aside
        if name in self.allowed:
            return await self.app(scope, receive, send)
        response = error_response(
            400,
            f"Host {host!r} is not a loopback name; a keyless server answers only those (serve.allowed_hosts)",
            "invalid_host",
        )
        return await response(scope, receive, send)

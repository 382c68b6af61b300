"""A /health prober in a process of its own (stdlib only): what a load balancer's health check sees.

    python tests/serve/_health_prober.py URL SERVER_PID OUT_FILE MAX_S

Every 0.1 s it opens a new connection, GETs URL and writes one line to OUT_FILE:

    started latency_s server_wait_s prober_wait_s status

`started` is time.monotonic() (one clock for every process of the machine, so a test can bin the lines by the
phases it stamped); `latency_s` the time from the request's start to its whole answer; `server_wait_s` how long,
meanwhile, the server's event-loop thread (its main thread: uvicorn's loop) was ready to run but waited for a
CPU, and `prober_wait_s` the same for this prober (Linux's /proc/.../schedstat, the run-queue delay). On an idle
machine both waits are ~0; on a machine whose cores other jobs hold, they are the part of the latency the
server's code could not have saved. Status is the HTTP status, 0 for no answer within 5 s. It stops after MAX_S.
"""

from __future__ import annotations

import http.client
import sys
import time
from urllib.parse import urlsplit


def run_queue_wait_s(path: str) -> float:
    """Seconds the thread whose schedstat is `path` waited on a run queue so far (0 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def probe(url: str) -> int:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        connection.request("GET", parts.path)
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        connection.close()


def main(url: str, server_pid: int, out: str, max_s: float) -> None:
    server_thread = f"/proc/{server_pid}/task/{server_pid}/schedstat"
    own_thread = "/proc/thread-self/schedstat"
    end = time.monotonic() + max_s
    with open(out, "a", buffering=1) as lines:
        while time.monotonic() < end:
            server_before, own_before = run_queue_wait_s(server_thread), run_queue_wait_s(own_thread)
            started = time.monotonic()
            status = probe(url)
            latency = time.monotonic() - started
            server_wait = run_queue_wait_s(server_thread) - server_before
            own_wait = run_queue_wait_s(own_thread) - own_before
            lines.write(f"{started:.6f} {latency:.6f} {server_wait:.6f} {own_wait:.6f} {status}\n")
            time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))

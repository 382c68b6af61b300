"""Clean stops (issue #47 item 5): SIGTERM to `lopd serve` under load. It must exit within its grace period with
143 and leave no process behind (the engine process included; tests/_stopping.py finds them by a marker in the
environment every descendant inherits)."""

import threading
import time
import uuid

import pytest
from _servers import free_port
from _stopping import GRACE_S, read_until, settle, start, terminate


@pytest.mark.slow
def test_sigterm_under_load_stops_serve(tmp_path, tiny_checkpoints):
    import httpx

    model = tiny_checkpoints[0]
    marker, port = uuid.uuid4().hex, free_port()
    argv = ["serve", "--model", str(model), "--port", str(port), "--store", str(tmp_path / "traces"), "--device", "cpu"]
    proc, lines = start(argv + ["--set", f"serve.stop_grace_s={GRACE_S}"], tmp_path, marker), []
    assert read_until(proc, "serving", 900, lines), "".join(lines)
    # "serving" is logged before uvicorn binds and the engine starts: wait for /health (bounded) before the load
    assert _healthy(f"http://127.0.0.1:{port}/health", 600), "".join(lines[-40:])
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 64}
    stop, answered = threading.Event(), []

    def load():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    answered.append(client.post(url, json=body).status_code)
                except httpx.HTTPError:
                    answered.append(None)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(8)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120  # under load on a busy 2-core machine a first answer may take a while
    while not any(code == 200 for code in answered) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert any(code == 200 for code in answered), answered[:20]
    code, seconds = terminate(proc)
    stop.set()
    print(f"lopd serve: exit {code} {seconds:.1f}s after SIGTERM under load ({len(answered)} requests)")
    assert code == 143, "".join(lines[-40:])
    assert seconds < GRACE_S + 5
    assert not settle(marker), settle(marker)


def _healthy(url: str, within_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False

"""Fixtures of the serving tests: two tiny checkpoints on disk (for hot swap) and a server on loopback.

The server is the real app under uvicorn in a thread of the test process, bound to 127.0.0.1 on a free port;
clients are the official `openai` package and httpx.
"""

from __future__ import annotations

import tempfile
import threading
import time

import httpx
import pytest
import torch

from lopd_core.config import TinyModelConfig

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def save_tiny(tokenizer, folder, seed: int):
    from lopd_core.model.loading import tiny_qwen3

    torch.manual_seed(seed)
    tiny_qwen3(TINY, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    return save_tiny(tiny_tokenizer, root / "a", 0), save_tiny(tiny_tokenizer, root / "b", 1)


class LiveServer:
    """uvicorn serving `app` on loopback in a thread; `url` is the OpenAI base URL (…/v1)."""

    def __init__(self, app):
        import uvicorn

        from tests._servers import free_port

        self.app = app
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + "/v1"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 300  # an engine process imports torch before the server answers
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the server did not come up within 300 s")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_server(folder, store_dir, **settings) -> LiveServer:
    from lopd_serve.app import create_app
    from lopd_serve.config import ServeConfig
    from lopd_serve.models import ModelHolder, load_checkpoint
    from lopd_serve.server import open_store

    # the tiny models have 1024 positions; the tests reload from (and a trainer syncs through) temporary folders;
    # they decode on a thread (an engine process takes seconds to start): the engine process has its own tests
    # (test_batch_faults.py, test_end_to_end.py)
    defaults = {"max_context": 1024, "reload_roots": [tempfile.gettempdir()], "engine": "thread"}
    cfg = ServeConfig.from_dict({"poll_s": 0.0, "store_dir": str(store_dir), "device": "cpu", **defaults, **settings})
    holder = ModelHolder(load_checkpoint(folder, device="cpu"), device="cpu", max_context=cfg.max_context)
    return LiveServer(create_app(cfg, holder, open_store(cfg)))


@pytest.fixture
def live(tiny_checkpoints, tmp_path):
    with make_server(tiny_checkpoints[0], tmp_path / "traces") as server:
        yield server

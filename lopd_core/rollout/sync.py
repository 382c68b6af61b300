"""Weight sync to inference servers: the policy saved as a Hugging Face checkpoint, then each server told to
reload from it (`POST /admin/reload {"model": DIR}` on `lopd serve`).

Why through a folder: it works with any server that can read the trainer's disk (the same machine, or a shared
filesystem named by `rollout.sync_dir`) and needs no process group between trainer and servers. vLLM's
weight-transfer API (NCCL or CUDA IPC, `--weight-transfer-config`) streams the tensors instead, with no disk
round-trip; docs/scaling.md says how to use it. The reload is synchronous: when this returns, every server
answers with the new weights.

A LoRA student is saved merged (a copy; the adapter stays trainable): a server loads plain checkpoints.
Under `accelerate`, only the main process syncs; the caller must gather a sharded model first.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import httpx

RELOAD_TIMEOUT_S = 900.0


def root_of(url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /admin/reload and /health live)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def save_policy(model, tokenizer, folder: Path) -> Path:
    """`model` (merged, if it carries a LoRA adapter) and its tokenizer as a checkpoint folder."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def default_sync_root() -> Path:
    """Where a trainer with no `rollout.sync_dir` saves each update for the servers on this machine: a folder of
    its own under the system's temporary folder, which `lopd serve` reloads from by default (serve.reload_roots)."""
    return Path(tempfile.gettempdir()) / "lopd-sync"


def temporary_sync_folder() -> Path:
    root = default_sync_root()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def sync_weights(
    model, tokenizer, servers, *, directory: str | Path | None = None, api_key: str | None = None
) -> list[str]:
    """Save `model` and make every server reload it; returns the version each server now serves.

    `directory`: a folder the servers can read (overwritten each time); None: a temporary folder, removed after
    the servers have loaded it. A server that fails to reload raises, naming it and its answer."""
    folder = Path(directory) if directory else temporary_sync_folder()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        save_policy(model, tokenizer, folder)
        versions = []
        for url in servers:
            response = httpx.post(
                root_of(url) + "/admin/reload",
                json={"model": str(folder.resolve())},
                headers=headers,
                timeout=RELOAD_TIMEOUT_S,
            )
            if response.status_code >= 400:
                raise RuntimeError(f"{root_of(url)}/admin/reload: HTTP {response.status_code}: {response.text[:500]}")
            versions.append(response.json().get("model_version", ""))
        return versions
    finally:
        if directory is None:
            shutil.rmtree(folder, ignore_errors=True)

"""Cache keys for expensive, deterministic stages: content hashes of input artifacts + their params sections.

Why not Prefect's default policy: it caches only within one flow run, and hashing task inputs would hash
whatever objects are passed (DESIGN §6: tensor pickles differ between processes). Here the flow computes a
stage key from what the stage reads — file contents, never paths or objects — and the part of params.yaml that
shapes its output, plus the content hash of the source the stage runs (its `code` in tasks/stage_params.py, the
same list dvc.yaml's deps are checked against). The stage then writes into a work folder
named by that key (`<cycle.dir>/work/<stage>-<key>`), so equal keys mean equal outputs in a known place, and a
key's outputs can be checked for presence before its cached result is trusted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from lopd_core.jsonio import write_json
from tasks.stage_params import STAGES

DONE = "_stage.json"  # written last by a stage: its summary, and the proof that its outputs are complete
KEY_FILE = "_key.json"  # the payload the stage's key was computed from
_CHUNK = 1 << 20
_SKIP_NAMES = {DONE, KEY_FILE, "__pycache__", ".DS_Store"}


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of one file; memoised on (path, size, mtime) so a long cycle hashes each weight file once."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def content_hash(path: str | Path | None) -> str:
    """Hash of a file's bytes, or of a folder's relative file names and bytes (order independent).
    A missing path hashes to a fixed marker, so "no input yet" is a value of its own."""
    if path is None:
        return "none"
    path = Path(path)
    if not path.exists():
        return "missing"
    if path.is_file():
        st = path.stat()
        return _file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path)
        if any(part in _SKIP_NAMES or part.endswith(".tmp") for part in rel.parts):
            continue
        h.update(rel.as_posix().encode() + b"\0" + content_hash(file).encode() + b"\n")
    return h.hexdigest()


# The repository root the table's code paths are relative to (a test points it at an edited copy).
CODE_ROOT = Path(__file__).resolve().parents[1]


def code_fingerprint(code: tuple[str, ...]) -> str:
    """Hash of the source files and folders `code` names (a stage's `code` in tasks/stage_params.py): an edit in
    what a stage runs invalidates its cached results, an edit elsewhere does not. Each file's digest is memoised
    on its size and mtime, so a cycle's many keys hash the library once."""
    h = hashlib.sha256()
    for rel in sorted(code):
        h.update(rel.encode() + b"\0" + content_hash(CODE_ROOT / rel).encode() + b"\n")
    return h.hexdigest()


def plugin_fingerprint(envs) -> dict[str, dict[str, list[str]]]:
    """Content hashes of what the mix's plugin environments read beyond lopd_core (`code_fingerprint`): each one's
    task file and its package's source (`registry.plugin_files`), name -> {"task_file": [...], "source": [...]}.
    Why: a plugin's class names its own task file and its tools are its package's code; hashing only the paths of
    `envs.task_files` let an edited task file or tool reuse a stale bank, student and evaluation."""
    from lopd_core.envs.registry import plugin_files

    return {
        name: {kind: [content_hash(path) for path in paths] for kind, paths in files.items()}
        for name, files in plugin_files(envs).items()
    }


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


def key_payload(
    stage: str, sections: dict[str, Any], inputs: dict[str, str | Path | None], code: tuple[str, ...] | None = None
) -> dict:
    """What a stage's cache key is made of: its name, params sections, inputs' content, the content of the code it
    runs (`code`; None: the table's `code` of `stage`). Kept beside the stage's outputs (KEY_FILE) so a
    surprising recomputation can be explained by a diff."""
    return {
        "stage": stage,
        "sections": {k: _plain(v) for k, v in sorted(sections.items())},
        "inputs": {k: content_hash(v) for k, v in sorted(inputs.items())},
        "code": code_fingerprint(STAGES[stage].code if code is None else code),
    }


def stage_key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def is_complete(work: str | Path) -> bool:
    return (Path(work) / DONE).exists()


def mark_complete(work: str | Path, summary: dict) -> dict:
    """Write the stage's summary last (atomically): its presence means the outputs beside it are whole."""
    write_json(Path(work) / DONE, summary, default=str)
    return summary


def by_stage_key(context, parameters: dict) -> str:
    """Prefect `cache_key_fn`: the key the flow computed from content hashes (see `stage_key`)."""
    return f"{parameters['stage']}-{parameters['key']}"

"""Experience bank: past successful trajectories, retrieved as top-J nearest successes per task.

    bank = ExperienceBank("data/bank/experience.parquet", index_dir="data/bank_index")
    bank.refresh(trajectory_frame, min_reward=1.0, policy_version="cycle-3", cycle=3)
    hits = bank.retrieve(tasks, j=3, allow_self_retrieval=True)   # list[list[BankHit]], best first

Parquet (store.py) is the source of truth; the Chroma collection (index.py) is derived from it and rebuilt
whenever it is missing, its recorded content hash differs from the parquet's, it was built under other HNSW
settings, or Chroma cannot read it (a damaged folder is deleted and written again, with a warning). Queries
embed each task's instruction (which begins with "[world]", so neighbours naturally share the world; no world
filter unless `same_world=True`) with the packaged MiniLM (embed.py), all tasks of a call in one batch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pandas as pd

from lopd_core.bank.embed import Embedder, get_embedder
from lopd_core.bank.index import (
    DEFAULT_COLLECTION,
    BankIndex,
    ClientSpec,
    client_spec,
    discard_folder,
    make_client,
)
from lopd_core.bank.schema import BANK_COLUMNS, BANK_SCHEMA, BankValidationError, row_key, validate_bank
from lopd_core.bank.store import (
    BankFileError,
    BankStore,
    RefreshReport,
    bank_content_hash,
    read_bank,
    write_bank,
)
from lopd_core.envs import Task


@dataclass(frozen=True)
class BankHit:
    task_id: str
    world: str
    template: str
    experience_text: str
    similarity: float  # cosine similarity of the task texts, in [-1, 1]
    row_id: str = ""


def default_index_dir(path: str | Path) -> Path:
    """Beside the parquet, never inside a tracked copy: `<stem>.chroma/` next to `<stem>.parquet`."""
    path = Path(path)
    return path.with_name(path.stem + ".chroma")


class ExperienceBank:
    """Parquet bank + Chroma index + embedder behind one object. Not thread-safe; one per process is enough."""

    def __init__(
        self,
        path: str | Path,
        *,
        index_dir: str | Path | None = None,
        chroma_url: str | None = None,
        collection: str = DEFAULT_COLLECTION,
        embedder: Embedder | None = None,
        hnsw: dict | None = None,
    ):
        self.store = BankStore(path)
        self.index_dir = Path(index_dir) if index_dir else default_index_dir(path)
        self.chroma_url = chroma_url or None
        self.collection = collection
        self.hnsw = dict(hnsw or {})
        self._embedder = embedder
        self._index: BankIndex | None = None
        self._synced: tuple | None = None  # (parquet stat signature, content hash) the index was last checked at
        self._frame: pd.DataFrame | None = None
        self.last_embedded = 0  # texts embedded by the last index rebuild

    # --- parts ---------------------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.store.path

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = get_embedder()
        return self._embedder

    @property
    def client_spec(self) -> ClientSpec:
        return client_spec(self.index_dir, self.chroma_url)

    @property
    def index(self) -> BankIndex:
        if self._index is None:
            self._index = BankIndex(make_client(self.client_spec), collection=self.collection, hnsw=self.hnsw)
        return self._index

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
        self._index, self._synced, self._frame = None, None, None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- parquet ---------------------------------------------------------------------------------------------
    def _signature(self) -> tuple:
        try:
            st = self.path.stat()
            return (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            return ()

    def frame(self) -> pd.DataFrame:
        """The bank's rows (validated). Cached until the file changes."""
        sig = self._signature()
        if self._frame is None or self._frame.attrs.get("signature") != sig:
            self._frame = self.store.load()
            self._frame.attrs["signature"] = sig
        return self._frame

    def __len__(self) -> int:
        return len(self.frame())

    def content_hash(self) -> str:
        return bank_content_hash(self.frame())

    def refresh(
        self, trajectories: pd.DataFrame, *, min_reward: float, policy_version: str, cycle: int, created_at=None
    ) -> RefreshReport:
        """Append the successes (reward >= min_reward) of a trajectory table; all-or-nothing; see store.py."""
        report = self.store.refresh(
            trajectories, min_reward=min_reward, policy_version=policy_version, cycle=cycle, created_at=created_at
        )
        self._frame = None
        return report

    # --- index -----------------------------------------------------------------------------------------------
    def ensure_index(self) -> bool:
        """Rebuild the Chroma collection if it is missing, stale or unreadable. Returns True when it rebuilt.

        An embedded folder Chroma cannot read (a damaged chroma.sqlite3) is derived data: it is deleted and built
        again from the parquet, with a warning. A server's storage is not this process's to delete: its errors
        are raised."""
        from chromadb.errors import ChromaError

        try:
            return self._sync_index()
        except ChromaError as exc:
            if self.client_spec.kind != "persistent":
                raise
            warnings.warn(
                f"bank index {self.index_dir}: Chroma cannot read it ({exc}); it is derived from "
                f"{self.path}, so it is deleted and rebuilt",
                RuntimeWarning,
                stacklevel=2,
            )
            self._discard_index()
            return self._sync_index()

    def _discard_index(self) -> None:
        if self._index is not None:
            with contextlib.suppress(Exception):  # a client on a damaged folder may fail to close as well
                self._index.close()
        self._index, self._synced = None, None
        discard_folder(self.index_dir)

    def _sync_index(self) -> bool:
        sig = self._signature()
        if self._synced is not None and self._synced[0] == sig and self.index.collection() is not None:
            return False
        frame = self.frame()
        digest = bank_content_hash(frame)
        model_id = self.embedder.model_id
        rebuilt = False
        if not self.index.is_current(digest, model_id):
            self.last_embedded = self.index.rebuild(frame, digest, model_id, self.embedder.encode)
            rebuilt = True
        self._synced = (sig, digest)
        return rebuilt

    def retrieve(
        self, tasks: Sequence[Task], j: int, allow_self_retrieval: bool = True, same_world: bool = False
    ) -> list[list[BankHit]]:
        """Top-j bank rows per task by cosine similarity of task texts, best first.

        allow_self_retrieval=False drops rows of the same task instance (same task_id) as the query;
        same_world=True restricts each task's neighbours to its own world (a Chroma `where` filter).
        """
        tasks = list(tasks)
        if not tasks or j <= 0:
            return [[] for _ in tasks]
        self.ensure_index()
        frame = self.frame()
        if len(frame) == 0:
            return [[] for _ in tasks]
        vectors = self.embedder.encode([t.instruction for t in tasks])
        extra = 0
        if not allow_self_retrieval:
            per_task = frame["task_id"].value_counts()
            extra = int(max(per_task.get(t.task_id, 0) for t in tasks))
        groups: dict[str | None, list[int]] = {}
        for i, t in enumerate(tasks):
            groups.setdefault(t.world if same_world else None, []).append(i)
        results: list[list[BankHit]] = [[] for _ in tasks]
        for world, idx in groups.items():
            where = {"world": world} if world is not None else None
            found = self.index.query(vectors[idx], j + extra, where=where)
            for i, hits in zip(idx, found):
                keep = [h for h in hits if allow_self_retrieval or h.metadata.get("task_id") != tasks[i].task_id]
                results[i] = [
                    BankHit(
                        task_id=h.metadata.get("task_id", ""),
                        world=h.metadata.get("world", ""),
                        template=h.metadata.get("template", ""),
                        experience_text=h.document,
                        similarity=h.similarity,
                        row_id=h.row_id,
                    )
                    for h in keep[:j]
                ]
        return results


__all__ = [
    "BANK_COLUMNS",
    "BANK_SCHEMA",
    "BankFileError",
    "BankHit",
    "BankIndex",
    "BankStore",
    "BankValidationError",
    "ClientSpec",
    "Embedder",
    "ExperienceBank",
    "RefreshReport",
    "bank_content_hash",
    "client_spec",
    "default_index_dir",
    "get_embedder",
    "make_client",
    "read_bank",
    "row_key",
    "validate_bank",
    "write_bank",
]

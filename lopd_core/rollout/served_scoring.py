"""Teacher scoring on an inference server: log-probs of given token sequences and the top-k at each position,
from the completions API's `prompt_logprobs` (vLLM's option; `lopd serve` answers it with
lopd_core/rollout/scoring.py, the function an in-process pass can call too).

Where it applies: the no-grad scoring passes whose teacher reads token ids only (a baseline's teacher with text
in context, a frozen base scoring the student's tokens) — the composer's gradient never needs them. A latent
teacher reads spliced embeddings, which the ids-only API cannot carry: it scores in process.
Shapes: N action tokens, k top entries.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from lopd_core.rollout.scoring import SequenceScores

TIMEOUT_S = 600.0


def served_scores(
    servers, sequences: list[list[int]], *, top_k: int, api_key_env: str = "LOPD_API_KEY", concurrency: int = 32
) -> list[SequenceScores]:
    """Scores of each sequence (see `SequenceScores`), the sequences spread over `servers` in contiguous
    slices and sent concurrently."""
    key = os.environ.get(api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    clients = [httpx.Client(headers=headers, timeout=TIMEOUT_S) for _ in servers]
    names = [c.get(url.rstrip("/") + "/models").json()["data"][0]["id"] for c, url in zip(clients, servers)]

    def one(i: int) -> SequenceScores:
        s = i * len(servers) // max(len(sequences), 1)
        body = {
            "model": names[s],
            "prompt": sequences[i],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
        }
        response = clients[s].post(servers[s].rstrip("/") + "/completions", json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"{servers[s]}/completions: HTTP {response.status_code}: {response.text[:500]}")
        return scores_of(sequences[i], response.json()["choices"][0]["prompt_logprobs"], top_k)

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(sequences)))) as pool:
            return list(pool.map(one, range(len(sequences))))
    finally:
        for client in clients:
            client.close()


def scores_of(ids: list[int], prompt_logprobs: list[dict | None], top_k: int) -> SequenceScores:
    """vLLM's `prompt_logprobs` (None, then per position {"<id>": {logprob, rank, ...}} holding the prompt's
    token and the top-k) as `SequenceScores`."""
    chosen, ranks, top_ids, top_lps = [], [], [], []
    for pos in range(1, len(ids)):
        entries = prompt_logprobs[pos]
        own = entries[str(ids[pos])]
        chosen.append(float(own["logprob"]))
        ranks.append(int(own["rank"]) if own.get("rank") is not None else 0)
        ranked = sorted(
            (
                (int(v["rank"]), int(t), float(v["logprob"]))
                for t, v in entries.items()
                if v.get("rank") is not None and int(v["rank"]) <= top_k
            )
        )
        top_ids.append([t for _, t, _ in ranked])
        top_lps.append([lp for _, _, lp in ranked])
    return SequenceScores(chosen, top_ids, top_lps, ranks)


def action_topk(scores: list[SequenceScores], action_masks: list[list[int]]):
    """The teacher's (N, k) top-k log-probs and ids and (N,) log-probs of the action tokens, in the order the
    in-process teacher pass lays them out (row by row, position by position; lopd_core/distill/scoring/teacher.py)."""
    values, indices, taken = [], [], []
    for row, mask in zip(scores, action_masks):
        for p, m in enumerate(mask):
            if m and p > 0:  # the output at p-1 predicts token p
                values.append(row.topk_logprobs[p - 1])
                indices.append(row.topk_ids[p - 1])
                taken.append(row.token_logprobs[p - 1])
    return torch.tensor(values), torch.tensor(indices, dtype=torch.long), torch.tensor(taken)

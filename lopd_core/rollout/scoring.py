"""Log-probs of a given token sequence under a model, position by position, with the top-k at each position:
what a no-grad teacher pass reads (the log-probs of the student's tokens and the teacher's top-k), and what an
inference server returns as `prompt_logprobs` (lopd serve computes them with this function; served.py asks
for them over HTTP).

The head runs in float32 on the final hidden states (lopd_core/model/head.py), as the teacher's in-process pass
(`lopd_core.distill.scoring.teacher.action_logits`) does, so served and in-process scores agree to float noise.
Shapes: T tokens, D width, V vocabulary, k top entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopd_core.model.head import head_logits

# Positions whose (rows, V) float32 logits are held at once: bounds the memory of a long sequence's scoring.
HEAD_CHUNK = 512


@dataclass(frozen=True)
class SequenceScores:
    """Scores of tokens 1..T-1 (token 0 has no prediction): `token_logprobs[t-1]` is log p(ids[t] | ids[:t]);
    `topk_ids` and `topk_logprobs` are the k most likely tokens at that position, most likely first."""

    token_logprobs: list[float]  # (T-1,)
    topk_ids: list[list[int]]  # (T-1, k)
    topk_logprobs: list[list[float]]  # (T-1, k)
    token_ranks: list[int]  # (T-1,) 1 + how many tokens the model found likelier than the given one


@torch.no_grad()
def score_sequence(model, ids: list[int], *, top_k: int) -> SequenceScores:
    """Log-softmax of the model's next-token logits at every position of `ids`, read at the next token, and its
    top-k. One forward, no cache, no sampling settings (a score is of the model, not of a temperature)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    body = getattr(model, "model", None)
    hidden = body(input_ids=x).last_hidden_state[0] if body is not None else None  # (T, D)
    chosen, ranks, top_ids, top_lps = [], [], [], []
    targets = x[0, 1:]  # (T-1,)
    for start in range(0, len(ids) - 1, HEAD_CHUNK):
        stop = min(start + HEAD_CHUNK, len(ids) - 1)
        logits = (
            head_logits(model, hidden[start:stop])
            if hidden is not None
            else model(input_ids=x).logits[0, start:stop].float()
        )  # (t, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs.gather(-1, targets[start:stop, None])  # (t, 1)
        chosen += picked.squeeze(-1).tolist()
        ranks += (1 + (logprobs > picked).sum(-1)).tolist()
        if top_k > 0:
            values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)  # (t, k)
            top_lps += values.tolist()
            top_ids += indices.tolist()
        else:
            top_lps += [[] for _ in range(stop - start)]
            top_ids += [[] for _ in range(stop - start)]
    return SequenceScores(chosen, top_ids, top_lps, ranks)

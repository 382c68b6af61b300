"""Log-probs in the shapes OpenAI and vLLM return them, from what the decoder and the scorer computed.

Chat: `choices[].logprobs.content` is one entry per sampled token {token, logprob, bytes, top_logprobs}. The
completions API's legacy shape is {tokens, token_logprobs, top_logprobs (one {token: logprob} per position),
text_offset}. vLLM's `prompt_logprobs` is a list over the prompt, None for its first token, then a
{"<token id>": {logprob, rank, decoded_token}} holding the prompt's own token and the top-k.

With `return_tokens_as_token_ids` a token reads "token_id:N" (vLLM's option): decoded text is ambiguous (two ids
may decode alike, a byte-level piece may not decode alone), an id is not. The log-probs are those of the
distribution each token was drawn from, after temperature and top-p, as the trajectory records them (vLLM
returns these with `--logprobs-mode processed_logprobs`).

A token top-p dropped has probability 0: its log-prob is -inf, which JSON cannot carry (a strict client refuses
it, and the server's own writer raised). It reads -9999.0, vLLM's value for the same case.
"""

from __future__ import annotations

import math

from lopd_core.rollout.scoring import SequenceScores

LOGPROB_FLOOR = -9999.0  # what a log-prob of -inf (or a NaN) is reported and stored as


def finite(logprob: float | None) -> float | None:
    if logprob is None or math.isfinite(logprob):
        return logprob
    return LOGPROB_FLOOR


def token_label(tokenizer, token_id: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(
    tokenizer, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], as_ids: bool
) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        label = token_label(tokenizer, token_id, as_ids)
        return {"token": label, "logprob": finite(logprob), "bytes": list(label.encode("utf-8"))}

    content = []
    for n, (token_id, logprob) in enumerate(zip(ids, logprobs)):
        row = entry(token_id, logprob)
        row["top_logprobs"] = [entry(t, v) for t, v in (top[n] if n < len(top) else [])]
        content.append(row)
    return {"content": content}


def completion_logprobs(
    tokenizer, ids: list[int], logprobs: list[float | None], top: list[list[tuple[int, float]]], as_ids: bool
) -> dict:
    tokens = [token_label(tokenizer, t, as_ids) for t in ids]
    offsets, at = [], 0
    for label in tokens:
        offsets.append(at)
        at += 0 if as_ids else len(label)
    top_maps = [
        None if lp is None else {token_label(tokenizer, t, as_ids): finite(v) for t, v in (top[n] or [])}
        for n, lp in enumerate(logprobs)
    ]
    logprobs = [finite(v) for v in logprobs]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_maps, "text_offset": offsets}


def prompt_logprobs(tokenizer, ids: list[int], scores: SequenceScores, k: int) -> list[dict | None]:
    out: list[dict | None] = [None]
    for pos in range(1, len(ids)):
        token_id, chosen = ids[pos], scores.token_logprobs[pos - 1]
        ranked = list(zip(scores.topk_ids[pos - 1][:k], scores.topk_logprobs[pos - 1][:k]))
        entries = {
            str(token_id): {
                "logprob": finite(chosen),
                "rank": scores.token_ranks[pos - 1],
                "decoded_token": token_label(tokenizer, token_id, False),
            }
        }
        for r, (t, v) in enumerate(ranked):
            entries.setdefault(
                str(t), {"logprob": finite(v), "rank": r + 1, "decoded_token": token_label(tokenizer, t, False)}
            )
        out.append(entries)
    return out

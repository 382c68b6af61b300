"""`POST /v1/completions`: raw generation and scoring on token ids, the API training rollouts speak.

Why this endpoint beside chat: a multi-turn rollout must keep its ids exactly as the engine would (the
environment's observation ids appended by the trainer, never text rendered again), and a teacher's scoring pass
needs the log-probs of given tokens. vLLM and SGLang accept a list of token ids as `prompt`, return the sampled
ids and their log-probs (`return_token_ids`, `logprobs`) and score a prompt (`prompt_logprobs`); this endpoint
takes the same request and answers in the same shape, so lopd_core/rollout/served.py speaks to all of them.

A turn ends at the model's end-of-turn token (it is the last of the returned ids and log-probs when sampled),
as the engine's turns do. Nothing here is recorded in the trace store: the trainer that asks records its own
trajectories; conversations of users go through chat completions.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Depends

from lopd_serve.logprobs import completion_logprobs, prompt_logprobs
from lopd_serve.protocol import ApiError, CompletionRequest


def _prompt_ids(req: CompletionRequest, loaded) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "prompt: one prompt per request (send several requests: they are batched)",
                "unsupported",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "invalid_token_id", param="prompt"
        )
    return list(prompt)


def _check(req: CompletionRequest, cfg, loaded, ids: list[int]) -> int:
    """Every limit a 4xx naming the field; returns max_tokens."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(req, name)
        if k is not None and k > cfg.max_top_logprobs:
            raise ApiError(
                400,
                f"{name}={k}: at most {cfg.max_top_logprobs} (serve.max_top_logprobs)",
                "too_many_logprobs",
                param=name,
            )
    if req.n not in (None, 1):
        raise ApiError(400, "n: only 1 choice per request is supported", "unsupported", param="n")
    if req.include_stop_str_in_output is False:
        raise ApiError(
            400,
            "include_stop_str_in_output: the end-of-turn token is always returned when sampled (leave it out)",
            "unsupported",
            param="include_stop_str_in_output",
        )
    if req.stop:
        raise ApiError(
            400,
            "stop: stop strings are not supported (a turn ends at the model's end token)",
            "unsupported",
            param="stop",
        )
    if req.stream:
        raise ApiError(
            400, "stream: not supported on /v1/completions (chat completions stream)", "unsupported", param="stream"
        )
    if req.stop_token_ids and req.stop_token_ids != [loaded.chat.im_end_id]:
        raise ApiError(
            400,
            f"stop_token_ids: only [{loaded.chat.im_end_id}] (the end-of-turn token) is supported",
            "unsupported",
            param="stop_token_ids",
        )
    max_tokens = req.max_tokens or cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_limit:
        raise ApiError(
            400,
            f"max_tokens={max_tokens}: at most {cfg.max_tokens_limit} (serve.max_tokens_limit)",
            "max_tokens_too_large",
            param="max_tokens",
        )
    if not ids or len(ids) + max_tokens > cfg.max_context:
        raise ApiError(
            400,
            f"the prompt is {len(ids)} tokens; with max_tokens={max_tokens} it must be within "
            f"1..{cfg.max_context} (serve.max_context)",
            "context_length_exceeded",
            param="prompt",
        )
    return max_tokens


def add_completions(app, cfg, batcher, holder, authorized) -> None:
    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(req: CompletionRequest):
        loaded = holder.current  # kept to the end of the request even if a swap happens meanwhile
        ids = await asyncio.to_thread(_prompt_ids, req, loaded)  # a long text prompt is tokenized off the loop
        max_tokens = _check(req, cfg, loaded, ids)
        seed = req.seed if req.seed is not None else batcher.draw_seed()
        out = await batcher.generate(
            loaded,
            ids,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=max_tokens,
            seed=seed % 2**63,
            top_logprobs=req.logprobs or 0,
        )
        scores = None
        if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
            scores = await batcher.score(loaded, ids, top_k=max(req.prompt_logprobs or 0, req.logprobs or 0))
        tok = loaded.tokenizer
        text = tok.decode(out.token_ids, skip_special_tokens=req.skip_special_tokens)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "stop" if out.stopped else "length",
            "stop_reason": None,
        }
        if req.logprobs is not None:
            shown, lps, top = list(out.token_ids), list(out.logprobs), list(out.top)
            if req.echo:  # the prompt's tokens first, scored; its first token has no log-prob
                k = req.logprobs
                shown = ids + shown
                lps = [None] + scores.token_logprobs + lps
                top = [[]] + [list(zip(i[:k], v[:k])) for i, v in zip(scores.topk_ids, scores.topk_logprobs)] + top
            choice["logprobs"] = completion_logprobs(tok, shown, lps, top, req.return_tokens_as_token_ids)
        if req.echo:
            choice["text"] = tok.decode(ids, skip_special_tokens=req.skip_special_tokens) + text
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, ids, scores, req.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = ids, list(out.token_ids)
        return {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": "text_completion",
            "created": int(time.time()),
            "model": loaded.name,
            "system_fingerprint": loaded.version,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(ids) + len(out.token_ids),
            },
        }

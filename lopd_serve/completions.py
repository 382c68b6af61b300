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

from fastapi import APIRouter, Depends, Response

from lopd_serve.deps import Admitted, Config, Decoder, Holder, authorized
from lopd_serve.logprobs import completion_logprobs, prompt_logprobs
from lopd_serve.protocol import ApiError, CompletionRequest, ignored_warning
from lopd_serve.responses import Completion, CompletionChoice, Usage

router = APIRouter(dependencies=[Depends(authorized)])


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


def _check_fits(req: CompletionRequest, cfg, loaded, ids: list[int], max_tokens: int) -> None:
    """What the request model cannot check alone: the stop ids the model has, and the context limit."""
    if req.stop_token_ids and req.stop_token_ids != [loaded.chat.im_end_id]:
        raise ApiError(
            400,
            f"stop_token_ids: only [{loaded.chat.im_end_id}] (the end-of-turn token) is supported",
            "unsupported",
            param="stop_token_ids",
        )
    if not ids or len(ids) + max_tokens > cfg.max_context:
        raise ApiError(
            400,
            f"the prompt is {len(ids)} tokens; with max_tokens={max_tokens} it must be within "
            f"1..{cfg.max_context} (serve.max_context)",
            "context_length_exceeded",
            param="prompt",
        )


@router.post("/v1/completions")
async def completions(
    req: CompletionRequest, cfg: Config, decoder: Decoder, holder: Holder, admission: Admitted, response: Response
) -> Completion:
    response.headers.update(ignored_warning(req))  # unknown fields, ignored: named in a header of the answer
    sampling = req.to_sampling(cfg, decoder.draw_seed)
    loaded = holder.current  # kept to the end of the request even if a swap happens meanwhile
    ids = await asyncio.to_thread(_prompt_ids, req, loaded)  # a long text prompt is tokenized off the loop
    _check_fits(req, cfg, loaded, ids, sampling.max_tokens)
    slot = admission.enter()  # 429 at once beyond the queue's bound
    try:
        out = await decoder.generate(
            loaded,
            ids,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            top_logprobs=sampling.top_logprobs,
            stop=sampling.stop,
        )
        scores = None
        if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
            scores = await decoder.score(loaded, ids, top_k=max(req.prompt_logprobs or 0, req.logprobs or 0))
    finally:
        slot.release()
    return Completion(
        model=loaded.name,
        system_fingerprint=loaded.version,
        choices=[_choice(req, loaded.tokenizer, ids, out, scores)],
        usage=Usage.of(len(ids), len(out.token_ids)),
    )


def _choice(req: CompletionRequest, tok, ids: list[int], out, scores) -> CompletionChoice:
    text = tok.decode(out.token_ids, skip_special_tokens=req.skip_special_tokens)
    if out.stop_string is not None and out.stop_string in text:  # the ids keep every sampled token (vLLM's)
        text = text[: text.index(out.stop_string)]
    finish = "stop" if out.stopped or out.stop_string is not None else "length"
    choice = CompletionChoice(text=text, finish_reason=finish)
    if req.logprobs is not None:
        shown, lps, top = list(out.token_ids), list(out.logprobs), list(out.top)
        if req.echo:  # the prompt's tokens first, scored; its first token has no log-prob
            k = req.logprobs
            shown = ids + shown
            lps = [None] + scores.token_logprobs + lps
            top = [[]] + [list(zip(i[:k], v[:k])) for i, v in zip(scores.topk_ids, scores.topk_logprobs)] + top
        choice.logprobs = completion_logprobs(tok, shown, lps, top, req.return_tokens_as_token_ids)
    if req.echo:
        choice.text = tok.decode(ids, skip_special_tokens=req.skip_special_tokens) + text
    if req.prompt_logprobs is not None:
        choice.prompt_logprobs = prompt_logprobs(tok, ids, scores, req.prompt_logprobs)
    if req.return_token_ids:
        choice.prompt_token_ids, choice.token_ids = ids, list(out.token_ids)
    return choice

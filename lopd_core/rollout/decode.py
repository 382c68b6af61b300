"""Batched decoding of one assistant turn with a KV cache: prefill (each distinct context once, then forked),
then token by token until every row has closed its turn.

The G samples of a task share their prompt (system and first user turn), and in their first turn their whole
contexts: `share_prompts` prefills each distinct context once, as one batch, and copies its last logits and KV
cache rows to every row that shares it. Causal attention makes a row's prefill depend on its own context only,
so the forked rows hold what an unshared prefill computes; `share_prompts=False` keeps the unshared path as the
reference the tests compare against. With the re-prefill path, later turns are prefilled per row: a two-part
prefill there (the shared prompt once, then each row's continuation on its forked cache) was tried and, on the
embedded base, cost more in its extra forward than it saved. The kept cache (kept_cache.py) needs neither: the
forked prompt rows stay in the cache for every later turn.

`generate_turn` is also what `lopd serve` decodes with: a per-token callback streams tokens as they are sampled,
and the top-k log-probs of each sampled position come from the same distribution the token was drawn from.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache

from lopd_core.model.head import head_logits, uses_float32_head
from lopd_core.rollout.trajectory import Sampling

# on_token(row, token_id, logprob, top): called as each token is sampled; top is [(token_id, logprob)].
TokenCallback = Callable[[int, int, float, list[tuple[int, float]]], None]


def sampling_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(B, V) log-probs of the distribution a token is drawn from: after temperature and top-p (tokens top-p
    drops are -inf); greedy reads the plain log-softmax. What `sample_logprobs` and served top-k log-probs read."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(dim=-1)
        drop_sorted = cum - sorted_lp.exp() >= sampling.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logprobs = torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)
    return logprobs


def _pick_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | list[torch.Generator]):
    """Sample (or take the argmax of) one token per row; return ids, their sampling log-probs (B,) and the
    (B, V) log-probs they were drawn from.

    `generator` is one stream for the whole batch, or one CPU stream per row (see `rollout`'s `seeds`)."""
    logprobs = sampling_logprobs(logits, sampling)
    if sampling.temperature == 0:
        ids = logprobs.argmax(dim=-1)
        return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1), logprobs
    if isinstance(generator, list):  # inverse CDF with one uniform per row from the row's own stream
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generator]).to(logits.device)
        cdf = logprobs.double().exp().cumsum(dim=-1)  # (B, V)
        ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    else:
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1), logprobs


def cache_keyword(model) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; accept either release line."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_padded(rows: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths (T_i, ...) -> (B, T, ...) left-padded with `fill`, and the (B, T) mask."""
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype, device=rows[0].device)
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)
    for row, r in enumerate(rows):  # left padding: every row's next token lands in the last column
        out[row, width - r.shape[0] :] = r
        attention[row, width - r.shape[0] :] = 1
    return out, attention


def _first_with_same_context(contexts: list[list[int]], context_embeds: list[torch.Tensor] | None) -> list[int]:
    """Per row, the first row whose context equals its own (itself when none before it). With input embeddings,
    equal ids are not enough: two samples may read different latents, so the embeddings must be equal too."""
    seen: dict[tuple[int, ...], list[int]] = {}
    owner = []
    for row, ids in enumerate(contexts):
        candidates = seen.setdefault(tuple(ids), [])
        match = next(
            (
                c
                for c in candidates
                if context_embeds is None
                or (
                    context_embeds[c].shape == context_embeds[row].shape
                    and torch.equal(context_embeds[c], context_embeds[row])
                )
            ),
            None,
        )
        if match is None:
            candidates.append(row)
            match = row
        owner.append(match)
    return owner


def _last_logits(model, cache: DynamicCache) -> Callable[..., torch.Tensor]:
    """A forward that extends `cache` and returns each row's (rows, V) float32 logits at its last position.

    A float32 model runs its own head. A bf16 model's head would round the logits to bf16 before the sampling
    log-softmax, so it runs the body and takes the head's matmul in float32 (lopd_core/model/head.py): the
    sampling log-probs then match the ones training scores the same tokens with."""
    if uses_float32_head(model) or not hasattr(model, "model"):  # no separate body to call: its own head
        keyword = cache_keyword(model)

        def own_head(**inputs) -> torch.Tensor:
            out = model(**inputs, use_cache=True, logits_to_keep=1, **{keyword: cache})
            return out.logits[:, -1, :]

        return own_head
    body = model.model
    keyword = cache_keyword(body)

    def float32_head(**inputs) -> torch.Tensor:
        hidden = body(**inputs, use_cache=True, **{keyword: cache}).last_hidden_state  # (rows, T, D)
        return head_logits(model, hidden[:, -1, :])

    return float32_head


@torch.no_grad()
def generate_turn(
    model,
    contexts: list[list[int]],
    *,
    sampling: Sampling,
    stop_id: int,
    pad_id: int,
    generator: torch.Generator | list[torch.Generator],
    context_embeds: list[torch.Tensor] | None = None,
    share_prompts: bool = True,
    on_token: TokenCallback | None = None,
    top_logprobs: int = 0,
) -> list[tuple[list[int], list[float]]]:
    """One assistant turn for each context, batched with a KV cache. Returns (ids, logprobs) per context;
    ids end with `stop_id` unless the turn ran out of `max_new_tokens`. With one generator per context, a
    context's stream advances only for the tokens it samples, so its turn never depends on its batch mates.

    `context_embeds`, when given, holds one (T_i', D) input-embedding tensor per context that the prefill reads
    instead of the context's ids — a latent teacher acting with its latents spliced into the first user turn
    (lopd_core/distill/teacher/teacher_rollout.py); T_i' may differ from len(context). Decoding then feeds ids as usual.

    `on_token(row, token_id, logprob, top)` is called for each token as soon as it is sampled (how `lopd serve`
    streams); `top` is [(token_id, logprob)] of the `top_logprobs` most likely tokens of the distribution the
    token was drawn from (empty when `top_logprobs` is 0)."""
    cache = DynamicCache()  # filled in place by every forward below
    step = _last_logits(model, cache)
    logits, attention, positions = _prefill(
        step,
        cache,
        contexts,
        context_embeds,
        share_prompts=share_prompts,
        pad_id=pad_id,
        device=next(model.parameters()).device,
    )
    turns, _, _ = _decode(
        step,
        logits,
        attention,
        positions,
        len(contexts),
        sampling=sampling,
        stop_id=stop_id,
        pad_id=pad_id,
        generator=generator,
        on_token=on_token,
        top_logprobs=top_logprobs,
    )
    return turns


def _prefill(
    step,
    cache: DynamicCache,
    contexts: list[list[int]],
    context_embeds: list[torch.Tensor] | None,
    *,
    share_prompts: bool,
    pad_id: int,
    device,
):
    """Prefill every context into the empty `cache` (each distinct one once when `share_prompts`, its rows then
    forked). Returns the (B, V) last logits and the (B, T) attention mask and position ids of the cache."""
    batch = len(contexts)
    owner = _first_with_same_context(contexts, context_embeds) if share_prompts else list(range(len(contexts)))
    distinct = sorted(set(owner))  # rows that are prefilled; every other row copies one of them
    if context_embeds is None:
        input_ids, attention = _left_padded(
            [torch.tensor(contexts[r], dtype=torch.long, device=device) for r in distinct], pad_id
        )
        prefill = {"input_ids": input_ids}
    else:
        embeds, attention = _left_padded([context_embeds[r].to(device) for r in distinct], 0.0)
        prefill = {"inputs_embeds": embeds}
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (U, T), U distinct contexts
    logits = step(**prefill, attention_mask=attention, position_ids=positions)  # (U, V)
    if len(distinct) < batch:  # fork: row r reads the prefill of the distinct context it shares
        fork = _fork_index(owner, distinct, device)  # (B,)
        cache.reorder_cache(fork)  # every layer's keys and values (U, H, T, d) -> (B, H, T, d)
        logits, attention, positions = logits[fork], attention[fork], positions[fork]
    return logits, attention, positions


def _fork_index(owner: list[int], distinct: list[int], device) -> torch.Tensor:
    """(B,) index into the distinct rows: which one each row copies."""
    slot = {r: i for i, r in enumerate(distinct)}
    return torch.tensor([slot[o] for o in owner], dtype=torch.long, device=device)


def _decode(
    step,
    logits: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    batch: int,
    *,
    sampling: Sampling,
    stop_id: int,
    pad_id: int,
    generator: torch.Generator | list[torch.Generator],
    on_token: TokenCallback | None = None,
    top_logprobs: int = 0,
):
    """Sample from the prefill's (B, V) last logits, then token by token with the cache until every row stops.

    Returns the (ids, logprobs) per row, the cache's (B, T) attention mask and (B,) how many of its produced
    tokens each row fed into the cache. A row that has stopped feeds pad tokens while its batch mates go on;
    their slots are masked out, so a cache kept for the next turn holds each row's own tokens only.
    `on_token` and `top_logprobs`: see `generate_turn`."""
    device = logits.device
    next_pos = positions[:, -1:] + 1  # (B, 1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    fed = torch.zeros(batch, dtype=torch.long, device=device)
    produced: list[list[int]] = [[] for _ in range(batch)]
    logps: list[list[float]] = [[] for _ in range(batch)]
    for _ in range(sampling.max_new_tokens):
        ids, lps, dist = _pick_step(logits, done, sampling, generator, pad_id, keep_dist=top_logprobs > 0)
        ids = ids.masked_fill(done, pad_id)
        ids_now, lps_now = ids.tolist(), lps.tolist()  # one device-to-host copy per step, not one per row
        top = _top_tokens(dist, top_logprobs) if on_token is not None and dist is not None else None
        for row in (~done).nonzero().flatten().tolist():
            produced[row].append(ids_now[row])
            logps[row].append(lps_now[row])
            if on_token is not None:
                on_token(row, ids_now[row], lps_now[row], top[row] if top else [])
        real = (~done).long()  # (B,) rows whose token this step is their own, stop token included
        done |= ids == stop_id
        if bool(done.all()):
            break
        attention = torch.cat([attention, real[:, None]], dim=1)
        fed += real
        logits = step(input_ids=ids[:, None], attention_mask=attention, position_ids=next_pos)
        next_pos = next_pos + 1
    return list(zip(produced, logps)), attention, fed


def _pick_step(
    logits: torch.Tensor,
    done: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | list[torch.Generator],
    pad_id: int,
    *,
    keep_dist: bool,
):
    """One decoding step's (B,) ids and log-probs and, when `keep_dist`, the (B, V) log-probs they were drawn
    from (rows of finished trajectories hold pad and 0). With one stream per row, finished rows draw nothing:
    their streams must not advance."""
    if not isinstance(generator, list):
        ids, lps, dist = _pick_tokens(logits, sampling, generator)
        return ids, lps, dist if keep_dist else None
    batch, device = logits.shape[0], logits.device
    live = (~done).nonzero().flatten().tolist()
    ids = torch.full((batch,), pad_id, dtype=torch.long, device=device)
    lps = torch.zeros(batch, device=device)
    picked, picked_lp, picked_dist = _pick_tokens(logits[live], sampling, [generator[r] for r in live])
    ids[live], lps[live] = picked, picked_lp.to(lps.dtype)
    if not keep_dist:
        return ids, lps, None
    dist = torch.zeros(logits.shape, dtype=torch.float32, device=device)
    dist[live] = picked_dist
    return ids, lps, dist


def _top_tokens(dist: torch.Tensor, k: int) -> list[list[tuple[int, float]]] | None:
    """Per row, the k most likely (token id, log-prob) of the (B, V) distribution; None when k is 0."""
    if k <= 0:
        return None
    values, indices = dist.topk(min(k, dist.shape[-1]), dim=-1)  # (B, k)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]

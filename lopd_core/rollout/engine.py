"""Batched multi-turn rollouts, token in and token out.

Each round generates one assistant turn for every unfinished trajectory of the batch, decoded with a KV cache
until every row has closed its turn with <|im_end|> (or hit `max_new_tokens`). The decoded action goes to that
trajectory's environment, and the tool observation is appended as forced ids. The batch's cache is kept from
round to round (`_KeptCache`): a later round prefills only each row's new tokens (the closing token the engine
added, the observation, the next assistant header), left-padded inside the rows, and finished rows are dropped
from the cache. `rollout(keep_cache=False)` instead left-pads and prefills every whole conversation each round
(`generate_turn`): simpler, and the reference the kept cache is tested against (tests/rollout/test_kept_cache.py).

The G samples of a task share their prompt (system and first user turn), and in their first turn their whole
contexts: `share_prompts` prefills each distinct context once, as one batch, and copies its last logits and KV
cache rows to every row that shares it. Causal attention makes a row's prefill depend on its own context only,
so the forked rows hold what an unshared prefill computes; `share_prompts=False` keeps the unshared path as the
reference the tests compare against. With the re-prefill path, later turns are prefilled per row: a two-part
prefill there (the shared prompt once, then each row's continuation on its forked cache) was tried and, on the
embedded base, cost more in its extra forward than it saved. The kept cache needs neither: the forked prompt
rows stay in the cache for every later turn.

What a trajectory records (the contract training relies on):
  * token_ids       — the whole conversation, exactly the ids the policy saw and produced;
  * action_mask     — 1 where the policy sampled the token (its actions and their closing <|im_end|>), 0 for
                      forced tokens (system, user, observations, turn framing, a closing <|im_end|> the engine
                      had to add after a turn ran out of tokens);
  * sample_logprobs — log-probability of each sampled token under the distribution it was drawn from
                      (after temperature and top-p; greedy records the plain log-softmax), 0 where forced;
  * reward, success, stop_reason and the environment's episode record.
Text is decoded only to hand an action to the environment; it is never tokenized again for training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lopd_core.envs import Task, make_env
from lopd_core.envs.base import checked_result
from lopd_core.errors import EnvironmentFault
from lopd_core.model.chat import ChatCodec, TrajectoryIds
from lopd_core.model.head import head_logits, uses_float32_head


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64  # per assistant turn
    max_context: int = 1024  # a trajectory that outgrows this is closed with stop_reason "context_limit"
    # An observation's own tokens beyond this are cut, and the model is told so (`bounded_observation`).
    max_observation_tokens: int = 512


@dataclass(frozen=True)
class RolloutRequest:
    task: Task
    sample_index: int = 0
    experiences: tuple[str, ...] = ()  # success texts placed in the first user turn (empty for the student)


@dataclass
class Trajectory:
    task: Task
    sample_index: int
    experiences: tuple[str, ...]
    token_ids: list[int]
    action_mask: list[int]
    sample_logprobs: list[float]
    prompt_length: int  # forced tokens before the first action
    reward: float = 0.0
    success: bool = False
    stop_reason: str = ""
    num_turns: int = 0
    episode: list[dict] = field(default_factory=list)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)


def _pick_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | list[torch.Generator]):
    """Sample (or take the argmax of) one token per row; return ids and their sampling log-probs. (B, V) -> (B,)

    `generator` is one stream for the whole batch, or one CPU stream per row (see `rollout`'s `seeds`)."""
    logits = logits.float()
    if sampling.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        ids = logprobs.argmax(dim=-1)
        return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(dim=-1)
        drop_sorted = cum - sorted_lp.exp() >= sampling.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logprobs = torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)
    if isinstance(generator, list):  # inverse CDF with one uniform per row from the row's own stream
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generator]).to(logits.device)
        cdf = logprobs.double().exp().cumsum(dim=-1)  # (B, V)
        ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    else:
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)


def cache_keyword(model) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; accept either release line."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_padded(rows: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths (T_i, ...) -> (B, T, ...) left-padded with `fill`, and the (B, T) mask."""
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype, device=rows[0].device)
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)
    for row, r in enumerate(rows):  # left padding: every row's next token lands in the last column
        out[row, width - r.shape[0]:] = r
        attention[row, width - r.shape[0]:] = 1
    return out, attention


def _first_with_same_context(contexts: list[list[int]], context_embeds: list[torch.Tensor] | None) -> list[int]:
    """Per row, the first row whose context equals its own (itself when none before it). With input embeddings,
    equal ids are not enough: two samples may read different latents, so the embeddings must be equal too."""
    seen: dict[tuple[int, ...], list[int]] = {}
    owner = []
    for row, ids in enumerate(contexts):
        candidates = seen.setdefault(tuple(ids), [])
        match = next((c for c in candidates if context_embeds is None
                      or (context_embeds[c].shape == context_embeds[row].shape
                          and torch.equal(context_embeds[c], context_embeds[row]))), None)
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
def generate_turn(model, contexts: list[list[int]], *, sampling: Sampling, stop_id: int, pad_id: int,
                  generator: torch.Generator | list[torch.Generator],
                  context_embeds: list[torch.Tensor] | None = None,
                  share_prompts: bool = True) -> list[tuple[list[int], list[float]]]:
    """One assistant turn for each context, batched with a KV cache. Returns (ids, logprobs) per context;
    ids end with `stop_id` unless the turn ran out of `max_new_tokens`. With one generator per context, a
    context's stream advances only for the tokens it samples, so its turn never depends on its batch mates.

    `context_embeds`, when given, holds one (T_i', D) input-embedding tensor per context that the prefill reads
    instead of the context's ids — a latent teacher acting with its latents spliced into the first user turn
    (lopd_core/lopd/teacher_rollout.py); T_i' may differ from len(context). Decoding then feeds ids as usual."""
    cache = DynamicCache()  # filled in place by every forward below
    step = _last_logits(model, cache)
    logits, attention, positions = _prefill(step, cache, contexts, context_embeds, share_prompts=share_prompts,
                                            pad_id=pad_id, device=next(model.parameters()).device)
    turns, _, _ = _decode(step, logits, attention, positions, len(contexts), sampling=sampling, stop_id=stop_id,
                          pad_id=pad_id, generator=generator)
    return turns


def _prefill(step, cache: DynamicCache, contexts: list[list[int]], context_embeds: list[torch.Tensor] | None, *,
             share_prompts: bool, pad_id: int, device):
    """Prefill every context into the empty `cache` (each distinct one once when `share_prompts`, its rows then
    forked). Returns the (B, V) last logits and the (B, T) attention mask and position ids of the cache."""
    batch = len(contexts)
    owner = _first_with_same_context(contexts, context_embeds) if share_prompts else list(range(len(contexts)))
    distinct = sorted(set(owner))  # rows that are prefilled; every other row copies one of them
    if context_embeds is None:
        input_ids, attention = _left_padded([torch.tensor(contexts[r], dtype=torch.long, device=device)
                                             for r in distinct], pad_id)
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


def _decode(step, logits: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, batch: int, *,
            sampling: Sampling, stop_id: int, pad_id: int, generator: torch.Generator | list[torch.Generator]):
    """Sample from the prefill's (B, V) last logits, then token by token with the cache until every row stops.

    Returns the (ids, logprobs) per row, the cache's (B, T) attention mask and (B,) how many of its produced
    tokens each row fed into the cache. A row that has stopped feeds pad tokens while its batch mates go on;
    their slots are masked out, so a cache kept for the next turn holds each row's own tokens only."""
    device = logits.device
    next_pos = positions[:, -1:] + 1  # (B, 1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    fed = torch.zeros(batch, dtype=torch.long, device=device)
    produced: list[list[int]] = [[] for _ in range(batch)]
    logps: list[list[float]] = [[] for _ in range(batch)]
    for _ in range(sampling.max_new_tokens):
        if isinstance(generator, list):  # finished rows draw nothing: their streams must not advance
            live = (~done).nonzero().flatten().tolist()
            ids = torch.full((batch,), pad_id, dtype=torch.long, device=device)
            lps = torch.zeros(batch, device=device)
            picked, picked_lp = _pick_tokens(logits[live], sampling, [generator[r] for r in live])
            ids[live], lps[live] = picked, picked_lp.to(lps.dtype)
        else:
            ids, lps = _pick_tokens(logits, sampling, generator)
        ids = ids.masked_fill(done, pad_id)
        ids_now, lps_now = ids.tolist(), lps.tolist()  # one device-to-host copy per step, not one per row
        for row in (~done).nonzero().flatten().tolist():
            produced[row].append(ids_now[row])
            logps[row].append(lps_now[row])
        real = (~done).long()  # (B,) rows whose token this step is their own, stop token included
        done |= ids == stop_id
        if bool(done.all()):
            break
        attention = torch.cat([attention, real[:, None]], dim=1)
        fed += real
        logits = step(input_ids=ids[:, None], attention_mask=attention, position_ids=next_pos)
        next_pos = next_pos + 1
    return list(zip(produced, logps)), attention, fed


class _KeptCache:
    """The KV cache of a batch's unfinished trajectories, kept from one turn to the next.

    Rows have different lengths: every turn appends one block to all rows, each row's new tokens at the block's
    right end and pad slots before them, masked out by the 2D attention mask; position ids continue each row's
    own count. So a turn prefills only what arrived since the last one (the closing token the engine added, the
    observation, the next assistant header) instead of the whole conversation.

    With input embeddings (a latent teacher), a later turn reads the tail of the embedder's output for the whole
    context: the splice sits in the first user turn, so the embeddings of a longer context extend those of the
    shorter one, and the tail holds the new tokens' own embeddings."""

    def __init__(self, model, pad_id: int):
        self.cache = DynamicCache()
        self.step = _last_logits(model, self.cache)
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.attention: torch.Tensor | None = None  # (B, W) 1 where the cache slot holds a row's own token
        self.next_pos: list[int] = []  # per row, the position its next token takes
        self.consumed: list[int] = []  # per row, how many of its context ids the cache holds
        self.embedded: list[int] = []  # per row, how many input positions its context's embeddings had

    def first_turn(self, contexts: list[list[int]], context_embeds: list[torch.Tensor] | None):
        """Prefill the whole contexts (each distinct one once, then forked); returns what `_decode` starts from."""
        logits, attention, positions = _prefill(self.step, self.cache, contexts, context_embeds,
                                                share_prompts=True, pad_id=self.pad_id, device=self.device)
        self.attention = attention
        self.next_pos = (positions[:, -1] + 1).tolist()
        self.consumed = [len(c) for c in contexts]
        self.embedded = [len(c) if context_embeds is None else e.shape[0] for c, e in
                         zip(contexts, context_embeds or contexts)]
        return logits, attention, positions

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (indices into the current rows), and the masked slots.

        Each round leaves masked slots in every row (the block's padding, the steps a row decoded nothing), and
        every later decoding step would attend over them; so the kept rows' own slots are moved to the right,
        in order, and the width shrinks to the longest row, as a fresh left-padded prefill would lay them out.
        The keys already carry their rotary positions, so moving a slot changes nothing it computes."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        attention = self.attention[index]  # (B', W)
        width = int(attention.sum(-1).max())
        # A stable sort puts each row's masked slots first and its own slots after them, in their order.
        slots = torch.sort(attention, dim=1, stable=True).indices[:, -width:]  # (B', W') columns to keep
        for layer in self.cache.layers:  # keys and values (B, H, W, d) -> (B', H, W', d)
            pick = slots[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys[index].gather(2, pick)
            layer.values = layer.values[index].gather(2, pick)
        self.attention = attention.gather(1, slots)
        self.next_pos = [self.next_pos[r] for r in rows]
        self.consumed = [self.consumed[r] for r in rows]
        self.embedded = [self.embedded[r] for r in rows]

    def next_turn(self, contexts: list[list[int]], context_embeds: list[torch.Tensor] | None):
        """Feed each row's ids beyond what its cache holds; returns what `_decode` starts from."""
        if context_embeds is None:
            rows = [torch.tensor(c[n:], dtype=torch.long, device=self.device) for c, n in zip(contexts, self.consumed)]
            block, fresh = _left_padded(rows, self.pad_id)
            inputs = {"input_ids": block}
        else:
            rows = []
            for c, e, n, m in zip(contexts, context_embeds, self.consumed, self.embedded):
                if e.shape[0] - m != len(c) - n:
                    raise ValueError("context_embedder: a longer context's embeddings must extend the shorter one's")
                rows.append(e[m:].to(self.device))
            block, fresh = _left_padded(rows, 0.0)
            inputs = {"inputs_embeds": block}
        start = torch.tensor(self.next_pos, dtype=torch.long, device=self.device)[:, None]
        positions = start + (fresh.cumsum(-1) - 1).clamp(min=0)  # (B, W_new): each row continues its own count
        self.attention = torch.cat([self.attention, fresh], dim=1)
        logits = self.step(**inputs, attention_mask=self.attention, position_ids=positions)
        self.next_pos = (positions[:, -1] + 1).tolist()
        self.consumed = [len(c) for c in contexts]
        self.embedded = [m + r.shape[0] for m, r in zip(self.embedded, rows)]
        return logits, self.attention, positions

    def after_decode(self, attention: torch.Tensor, fed: torch.Tensor) -> None:
        """Account for the produced tokens each row fed into the cache while decoding."""
        self.attention = attention
        fed_now = fed.tolist()
        self.next_pos = [p + f for p, f in zip(self.next_pos, fed_now)]
        self.consumed = [n + f for n, f in zip(self.consumed, fed_now)]
        self.embedded = [m + f for m, f in zip(self.embedded, fed_now)]


# Characters of an observation tokenized at most to find its first `max_observation_tokens` tokens: a token
# rarely spans more, and a multi-megabyte observation is never tokenized whole.
CHARS_PER_TOKEN_BOUND = 16
TRUNCATION_MARK = "\n[observation truncated: {n} more characters not shown]"


def bounded_observation(codec, text: str, cap: int) -> str:
    """`text` when it is at most `cap` tokens; else its head and a mark saying how many characters were cut, at
    most `cap` tokens together. Why: an environment's observation has no size limit of its own, and a huge one
    became one huge context (in the rollout, then in every teacher pass over it); the mark tells the model the
    view is partial rather than letting it read a cut-off text as whole."""
    text = text.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate would crash the tokenizer
    if 2 * len(text.encode("utf-8")) <= cap:  # tokens hardly ever hold less than a byte: it fits, untokenized
        return text
    head = text[:cap * CHARS_PER_TOKEN_BOUND]
    ids = codec.encode(head)
    if len(head) == len(text) and len(ids) <= cap:
        return text
    keep = min(len(ids), cap)
    for _ in range(8):  # decoding a cut and encoding it again can differ by a token or two at the seam
        shown = codec.tokenizer.decode(ids[:keep], skip_special_tokens=False)
        out = shown + TRUNCATION_MARK.format(n=max(len(text) - len(shown), 1))
        excess = len(codec.encode(out)) - cap
        if excess <= 0:
            return out
        keep = max(keep - excess, 0)
    return TRUNCATION_MARK.format(n=len(text)).strip()[:cap]


def _bounded_episode(episode: list[dict], codec, cap: int) -> list[dict]:
    """The environment's episode record with each observation as the model saw it (`bounded_observation`): a
    huge observation is not carried on into the trajectory table and the bank either."""
    out = []
    for entry in episode:
        obs = entry.get("observation") if isinstance(entry, dict) else None
        if isinstance(obs, str) and len(obs) > cap:
            entry = {**entry, "observation": bounded_observation(codec, obs, cap)}
        out.append(entry)
    return out


def _finish(traj: Trajectory, env, result, stop_reason: str | None = None, codec=None, cap: int = 0) -> None:
    traj.reward = float(result.reward)
    traj.success = bool(result.info.get("success", False))
    traj.stop_reason = stop_reason or result.info.get("stop_reason", "")
    traj.episode = list(env.episode) if codec is None else _bounded_episode(list(env.episode), codec, cap)


def _check_first_turn(traj: Trajectory, extra: int, sampling: Sampling) -> None:
    """A first turn too long to leave room for one assistant turn within `max_context` cannot be played: the
    error names the task (its system text, instruction or experiences are too long for the setting)."""
    length = len(traj.token_ids) + extra
    if length + sampling.max_new_tokens > sampling.max_context:
        latents = f" and {extra} spliced positions" if extra else ""
        raise EnvironmentFault(
            f"task {traj.task.task_id!r} of env {traj.task.env!r}: its first turn is {len(traj.token_ids)} tokens"
            f"{latents}, which with rollout.max_new_tokens={sampling.max_new_tokens} exceeds the context limit of "
            f"{sampling.max_context}: shorten the task's system text or instruction, or raise rollout.max_context")


@torch.no_grad()
def rollout(model, codec: ChatCodec, requests: list[RolloutRequest], *, sampling: Sampling,
            batch_size: int = 32, seed: int = 0, seeds: list[int] | None = None, progress=None,
            context_embedder: Callable[[int, list[int]], torch.Tensor] | None = None,
            keep_cache: bool = True) -> list[Trajectory]:
    """Play every request to the end; deterministic for a given seed, model and request order.

    `context_embedder(request_index, token_ids)`, when given, returns the input embeddings each prefill reads for
    that request's context (see `generate_turn`): how a latent teacher plays. The trajectory still records the
    plain ids, so it can be scored like any other.

    `seeds` (one per request) gives each trajectory its own CPU sampling stream instead of one stream for the
    batch: a trajectory then depends only on its own seed, not on which requests share its batch — what lets
    ranks of a distributed run, each rolling out its shard, sample exactly what one process would (up to
    float noise in batched logits).

    `keep_cache` keeps each trajectory's KV cache from one turn to the next, so a turn prefills only its new
    tokens (`_KeptCache`); `keep_cache=False` re-prefills every conversation each turn (`generate_turn`), the
    reference it is tested against. The two differ only by float noise in the logits."""
    was_training = model.training
    model.eval()
    if seeds is not None and len(seeds) != len(requests):
        raise ValueError(f"seeds: got {len(seeds)} for {len(requests)} requests")
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    streams = [torch.Generator().manual_seed(int(s)) for s in seeds] if seeds is not None else None
    trajectories: list[Trajectory] = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        envs, trajs = [], []
        for req in chunk:
            env = make_env(req.task)
            first = env.reset(req.task)
            ids: TrajectoryIds = codec.start(first.system, first.user, list(req.experiences) or None,
                                             tools=list(first.tools) or None)
            envs.append(env)
            trajs.append(Trajectory(req.task, req.sample_index, req.experiences, ids.token_ids,
                                    ids.action_mask, ids.sample_logprobs, prompt_length=len(ids)))
        active = list(range(len(chunk)))
        kept = _KeptCache(model, codec.pad_id) if keep_cache else None
        extra = [0] * len(chunk)  # positions a context embedder splices in beyond the ids (its latents)
        first_round = True
        while active:
            embeds = (None if context_embedder is None
                      else [context_embedder(start + i, trajs[i].token_ids) for i in active])
            if first_round:  # every context is checked before a token is spent on it
                for row, i in enumerate(active):
                    extra[i] = 0 if embeds is None else int(embeds[row].shape[0]) - len(trajs[i].token_ids)
                    _check_first_turn(trajs[i], extra[i], sampling)
                first_round = False
            contexts = [trajs[i].token_ids for i in active]
            turn_generator = generator if streams is None else [streams[start + i] for i in active]
            if kept is None:
                turns = generate_turn(model, contexts, sampling=sampling, stop_id=codec.im_end_id,
                                      pad_id=codec.pad_id, generator=turn_generator, context_embeds=embeds)
            else:
                logits, attention, positions = (kept.first_turn(contexts, embeds)
                                                if kept.attention is None else kept.next_turn(contexts, embeds))
                turns, attention, fed = _decode(kept.step, logits, attention, positions, len(active),
                                                sampling=sampling, stop_id=codec.im_end_id, pad_id=codec.pad_id,
                                                generator=turn_generator)
                kept.after_decode(attention, fed)
            still, still_rows = [], []  # trajectories that play on, and their rows in this round's batch
            for row, (i, (ids, lps)) in enumerate(zip(active, turns)):
                traj, env = trajs[i], envs[i]
                grow = TrajectoryIds(traj.token_ids, traj.action_mask, traj.sample_logprobs)
                grow.add_action(ids, lps)
                if not ids or ids[-1] != codec.im_end_id:
                    grow.add_forced([codec.im_end_id])  # the engine closed the turn, not the policy
                traj.num_turns += 1
                cap = sampling.max_observation_tokens
                result = checked_result(traj.task, env.step(codec.decode_action(ids)))
                if result.done:
                    _finish(traj, env, result, codec=codec, cap=cap)
                    continue
                observation = codec.observation_ids(bounded_observation(codec, result.observation, cap))
                # The next turn must fit whole (the observation, then up to max_new_tokens of action): else the
                # episode is closed here, and no context ever outgrows max_context.
                if len(traj.token_ids) + extra[i] + len(observation) + sampling.max_new_tokens > sampling.max_context:
                    _finish(traj, env, checked_result(traj.task, env.step("")), stop_reason="context_limit",
                            codec=codec, cap=cap)  # the empty answer closes it
                    continue
                grow.add_forced(observation)
                still.append(i)
                still_rows.append(row)
            if kept is not None and still:
                kept.keep_rows(still_rows)
            active = still
        trajectories.extend(trajs)
        if progress is not None:
            progress(len(trajectories), len(requests))
    model.train(was_training)
    return trajectories

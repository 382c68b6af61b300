"""Continuous batching: requests join a running batch at any step and leave it the step they finish (vLLM's
scheduling, on the pieces of the rollout engine's decoder, decode.py).

Why: `generate_turn` decodes a fixed batch until its last row is done, so a request arriving meanwhile waits for
the whole batch, and a finished row is answered only when its batch ends. A server whose clients send their next
request as soon as they are answered then alternates between decoding and waiting for requests. Here every step
is one forward over the rows present, a row that finished is dropped before the next one, and a row that joins
feeds its whole context in the step it joins: in a forward of the joiners alone, whose keys and values are then
appended to the batch's cache (`_prefill_apart`), so that a join does not run every row at the prompt's width.

The cache holds one row per request. A row that leaves frees its cache row; a row that joins takes a free cache
row (its old slots masked) or, when none is free, a new one with every earlier slot masked. The masked slots (a
joiner's history, the decode rows' padding in a prefill block, a departed row's place) are squeezed out by one
gather of the whole cache (`_compact`, as kept_cache.keep_rows does) only once they are a large share of it: the
width past twice the longest row, or more than a quarter of the rows free. Why not after every join and
leave: a server's clients send their next turn as soon as they are answered, so rows leave and join nearly every
step, and a gather per event would copy the whole cache each time; lazily, a leave followed by a join reuses the
row, and the cost of a gather is spread over the steps that filled the waste. A free row rides along the forward
attending to its own new slot only (no row is ever wholly masked) and samples nothing.

Each row samples from its own seeded stream with its own temperature and top-p, drawing one uniform per sampled
token as `generate_turn` does with one generator per row: a request samples what it would have sampled alone, up
to float noise in batched logits.

A row with a `constraint` (constrained.py: a JSON answer, a tool call) samples only among the tokens that keep its
output a valid prefix: its logits are masked to -inf elsewhere before temperature and top-p, so the log-probs it
keeps are those of the masked distribution it was drawn from, and each kept token advances the constraint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lopd_core.rollout.constrained import Constrained
from lopd_core.rollout.decode import _last_logits, _left_padded, _pick_tokens, _top_tokens
from lopd_core.rollout.trajectory import Sampling


@dataclass
class Request:
    """One turn to decode: the context ids, its sampling, its own stream, and who hears each token."""

    context: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    generator: torch.Generator  # advanced one uniform per sampled token (none when greedy)
    top_logprobs: int = 0
    on_token: Callable[[int, float, list], None] | None = None  # (token id, log-prob, top-k) per kept token
    constraint: Constrained | None = None  # the output it must write (its tokens masked to the valid ones)
    ids: list[int] = field(default_factory=list)  # sampled so far
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def finished(self, stop_id: int) -> bool:
        return len(self.ids) >= self.max_tokens or bool(self.ids and self.ids[-1] == stop_id)


class _Row:
    def __init__(self, request: Request):
        self.request = request
        self.pending = list(request.context) + list(request.ids)  # ids the cache does not hold yet
        self.next_pos = 0  # the position the first pending id takes


class ContinuousBatch:
    """The rows being decoded with one model. `add` a request any time; each `step` feeds every row's pending
    ids, samples one token per row and returns the requests that finished (dropped from the batch)."""

    def __init__(self, model, *, stop_id: int, pad_id: int):
        self.model, self.stop_id, self.pad_id = model, stop_id, pad_id
        self.device = next(model.parameters()).device
        self.rows: list[_Row | None] = []  # one per cache row; None: a free row (its request left)
        self.compactions = 0  # gathers of the whole cache so far (the waste they squeeze is bounded, not zero)
        self._reset()

    def _reset(self) -> None:
        self.rows = [row for row in self.rows if row is not None]
        self.cache = DynamicCache()
        self.step_logits = _last_logits(self.model, self.cache)
        self.attention: torch.Tensor | None = None  # (B, T) 1 where the cache slot holds the row's own token

    def __len__(self) -> int:
        return sum(row is not None for row in self.rows)

    def requests(self) -> list[Request]:
        return [row.request for row in self.rows if row is not None]

    def add(self, request: Request) -> None:
        row = _Row(request)
        if self.attention is None:  # nothing cached yet: the row feeds everything at the next step
            self.rows.append(row)
            return
        free = next((n for n, kept in enumerate(self.rows) if kept is None), None)
        if free is not None:  # its attention row is already all masked (remove)
            self.rows[free] = row
            return
        # a new cache row, its history masked: (B, H, T, d) -> (B + 1, H, T, d)
        self.attention = torch.cat([self.attention, self.attention.new_zeros((1, self.attention.shape[1]))])
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((1, *layer.keys.shape[1:]))])
            layer.values = torch.cat([layer.values, layer.values.new_zeros((1, *layer.values.shape[1:]))])
        self.rows.append(row)

    def remove(self, requests: list[Request]) -> None:
        gone = {id(r) for r in requests}
        leaving = [n for n, row in enumerate(self.rows) if row is not None and id(row.request) in gone]
        if not leaving:
            return
        for n in leaving:
            self.rows[n] = None
        if not len(self):
            self.rows = []
            self._reset()
        elif self.attention is not None:
            self.attention[leaving] = 0
            self._compact_if_wasteful()

    def rebuild(self) -> None:
        """Drop the cache: every row feeds its whole context and sampled ids again at the next step (after a
        failed step, whatever it left in the cache)."""
        self._reset()
        for row in self.rows:
            row.pending, row.next_pos = list(row.request.context) + list(row.request.ids), 0

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One forward over every row's pending ids, one token sampled per row; returns the finished requests."""
        live = [row for row in self.rows if row is not None]
        joined = any(len(row.pending) != 1 for row in live)
        if joined and self.attention is not None and any(row.next_pos for row in live):
            logits = self._prefill_apart()  # requests join rows already decoding
        else:
            logits = self._forward(joined)
            for row in live:
                row.next_pos += len(row.pending)
        self._sample(logits)
        done = [row.request for row in live if row.request.finished(self.stop_id)]
        for row in live:
            row.pending = [row.request.ids[-1]]
        if done:
            self.remove(done)
        elif joined:  # the decode rows' padding in the prefill block
            self._compact_if_wasteful()
        return done

    def _forward(self, joined: bool) -> torch.Tensor:
        """Every row's pending ids in one (B, W) block through the cache; returns each row's last logits."""
        block, fresh, positions = self._block(joined)
        attention = fresh if self.attention is None else torch.cat([self.attention, fresh], dim=1)
        logits = self.step_logits(input_ids=block, attention_mask=attention, position_ids=positions)  # (B, V)
        free = [n for n, row in enumerate(self.rows) if row is None]
        if free:  # a free row attended to its own pad slot only; nothing of it is kept
            attention[free] = 0
        self.attention = attention
        return logits

    def _prefill_apart(self) -> torch.Tensor:
        """A step where requests join rows already decoding. Fed in the decode rows' block, a joiner's prompt would
        make every row of the step run at the prompt's width; so the joiners' prompts run in a forward of their
        own (a fresh cache), their keys and values are appended to the batch's cache in slots the other rows mask,
        and the decode rows take their one-token step as usual, a joiner feeding a pad there (its slot masked, its
        logits those of its own prefill). vLLM separates prefill from decode for the same reason."""
        joiners = [n for n, row in enumerate(self.rows) if row is not None and row.next_pos == 0]
        prompts = [torch.tensor(self.rows[n].pending, dtype=torch.long, device=self.device) for n in joiners]
        block, fresh = _left_padded(prompts, self.pad_id)  # (J, W)
        own = DynamicCache()
        positions = (fresh.cumsum(-1) - 1).clamp(min=0)
        first = _last_logits(self.model, own)(input_ids=block, attention_mask=fresh, position_ids=positions)
        index = torch.tensor(joiners, dtype=torch.long, device=self.device)
        appended = self.attention.new_zeros((len(self.rows), block.shape[1]))
        appended[index] = fresh.to(appended.dtype)
        for layer, theirs in zip(self.cache.layers, own.layers):  # (B, H, T, d) -> (B, H, T + W, d)
            for name in ("keys", "values"):
                ours, part = getattr(layer, name), getattr(theirs, name)
                slots = ours.new_zeros((ours.shape[0], ours.shape[1], part.shape[2], ours.shape[3]))
                slots[index] = part
                setattr(layer, name, torch.cat([ours, slots], dim=2))
        self.attention = torch.cat([self.attention, appended], dim=1)
        joining = set(joiners)
        decoding = [row for n, row in enumerate(self.rows) if row is not None and n not in joining]
        for n in joiners:  # past its prompt, feeding a pad in the decode rows' step
            row = self.rows[n]
            row.pending, row.next_pos = [self.pad_id], len(row.pending)
        logits = self._forward(joined=False)  # (B, V) the decode rows' step
        self.attention[index, -1] = 0  # the joiners' pad slot
        for row in decoding:
            row.next_pos += 1
        logits[index] = first.to(logits.dtype)
        return logits

    def _block(self, joined: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's (B, W) input ids, their mask and positions: each row's pending ids at the block's right
        end, each row continuing its own count. A step where every row feeds one token (most of them) builds
        the (B, 1) block directly."""
        pending = [[self.pad_id] if row is None else row.pending for row in self.rows]
        next_pos = [0 if row is None else row.next_pos for row in self.rows]
        if not joined:
            block = torch.tensor(pending, dtype=torch.long, device=self.device)
            positions = torch.tensor([[pos] for pos in next_pos], device=self.device)
            return block, torch.ones_like(block), positions
        block, fresh = _left_padded(
            [torch.tensor(ids, dtype=torch.long, device=self.device) for ids in pending], self.pad_id
        )
        start = torch.tensor(next_pos, device=self.device)[:, None]
        return block, fresh, start + (fresh.cumsum(-1) - 1).clamp(min=0)

    def _sample(self, logits: torch.Tensor) -> None:
        """Per group of rows sharing (temperature, top_p): one token each from its own stream, kept with its
        log-prob and, when asked, the top-k of the distribution it was drawn from. A constrained row's logits are
        masked first."""
        live = [(n, row) for n, row in enumerate(self.rows) if row is not None]
        for n, row in live:
            if row.request.constraint is not None:
                allowed = row.request.constraint.mask(logits.shape[-1]).to(logits.device)  # (V,)
                logits[n] = logits[n].masked_fill(~allowed, float("-inf"))
        groups: dict[tuple[float, float], list[int]] = {}
        for n, row in live:
            groups.setdefault((row.request.temperature, row.request.top_p), []).append(n)
        for (temperature, top_p), members in groups.items():
            index = torch.tensor(members, device=logits.device)
            sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=1)
            generators = [self.rows[n].request.generator for n in members]
            ids, lps, dist = _pick_tokens(logits[index], sampling, generators)
            k = max(self.rows[n].request.top_logprobs for n in members)
            top = _top_tokens(dist, k)
            for j, (token_id, logprob) in enumerate(zip(ids.tolist(), lps.tolist())):
                request = self.rows[members[j]].request
                _keep(request, token_id, logprob, top[j][: request.top_logprobs] if top else [])

    def _compact_if_wasteful(self) -> None:
        """Squeeze the masked slots and free rows out once they are a large share of the cache (module
        docstring): the width past twice the longest row, or more than a quarter of the rows free."""
        keep = [n for n, row in enumerate(self.rows) if row is not None]
        longest = int(self.attention[keep].sum(-1).max())
        if self.attention.shape[1] > 2 * max(longest, 1) or 4 * (len(self.rows) - len(keep)) > len(self.rows):
            self.rows = [self.rows[n] for n in keep]
            self._compact(keep)
            self.compactions += 1

    def _compact(self, keep: list[int]) -> None:
        """Keep rows `keep` (indices into the cache's rows) and only their own slots: each row's slots moved to
        the right in order, the width cut to the longest row. Keys carry their rotary positions already, so
        moving a slot changes nothing it computes."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        attention = self.attention[index]  # (B', T)
        width = max(int(attention.sum(-1).max()), 1)
        slots = torch.sort(attention, dim=1, stable=True).indices[:, -width:]  # (B', T') columns kept
        for layer in self.cache.layers:  # (B, H, T, d) -> (B', H, T', d)
            pick = slots[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys[index].gather(2, pick)
            layer.values = layer.values[index].gather(2, pick)
        self.attention = attention.gather(1, slots)


def _keep(request: Request, token_id: int, logprob: float, top: list) -> None:
    if request.constraint is not None:
        request.constraint.advance(token_id)
    request.ids.append(token_id)
    request.logprobs.append(logprob)
    request.top.append(top)
    if request.on_token is not None:
        request.on_token(token_id, logprob, top)


def probe(model, request: Request) -> None:
    """A forward over the request's whole sequence alone: raises what it raises in a batch (a context the model
    cannot read), so a failed step can tell the failing request from its batch mates."""
    ids = torch.tensor([list(request.context) + list(request.ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)

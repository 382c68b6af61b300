"""The KV cache of a batch's unfinished trajectories, kept from one turn to the next (rollout's `keep_cache`).

A later round prefills only each row's new tokens (the closing token the engine added, the observation, the next
assistant header), left-padded inside the rows, and finished rows are dropped from the cache.
`rollout(keep_cache=False)` instead re-prefills every whole conversation each round (`generate_turn`): simpler,
and the reference the kept cache is tested against (tests/rollout/test_kept_cache.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from lopd_core.rollout.decode import _last_logits, _left_padded, _prefill


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
        logits, attention, positions = _prefill(
            self.step, self.cache, contexts, context_embeds, share_prompts=True, pad_id=self.pad_id, device=self.device
        )
        self.attention = attention
        self.next_pos = (positions[:, -1] + 1).tolist()
        self.consumed = [len(c) for c in contexts]
        self.embedded = [
            len(c) if context_embeds is None else e.shape[0] for c, e in zip(contexts, context_embeds or contexts)
        ]
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

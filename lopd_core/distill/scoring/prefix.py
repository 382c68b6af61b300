"""Scoring action tokens with each shared prompt run once: the G samples of a task read one prompt.

A step's G samples of a task start from the same prompt (system turn, first user turn) and, for the latent
teacher, the same J·K latents spliced into it; they differ only from the first sampled token on. Scoring every
row from its first token repeats the prompt's forward — and, for the composer, its backward — G times, and the
latents make the teacher's prompt the longest part of a short trajectory. Here each distinct prompt runs once,
its per-layer keys and values are gathered for the rows that share it, and only each row's continuation runs
through the model. Causal attention makes this exact (up to float summation order): no prompt position can
see what follows it, so the prompt's states are the same in every row that shares it.

Rows share a prompt when their ids before the first action token are equal and the caller gives them the same
`context_keys` entry (which latents or text they read: equal keys must mean equal context tensors). The split
sits one token before the first action token, because the output there predicts it: every action prediction
comes from the continuation. Gradients reach the latents (and, with a trainable model, the weights) through
the gathered keys and values, once per prompt. Shapes: B rows, P prompt width, C continuation width, D width,
N action tokens in the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from lopd_core.distill.scoring.teacher import Framing, action_positions, embed_row
from lopd_core.model.head import head_logits
from lopd_core.rollout.engine import cache_keyword


@dataclass
class ActionScores:
    """Logits at the batch's action tokens, in build_batch's order (row by row, positions ascending)."""

    logits: Tensor  # (N, V) float32
    action_ids: Tensor  # (N,)
    token_traj_index: Tensor  # (N,) row of each action token
    prompts: int  # distinct prompts run (≤ B)


def _pad(rows: list[Tensor], width: int) -> tuple[Tensor, Tensor]:
    """Right-pad (L_i, D) rows to (R, width, D) and their (R, width) attention mask."""
    out = rows[0].new_zeros((len(rows), width, rows[0].shape[1]))
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return out, mask


def score_actions_shared(
    model,
    token_ids: list[list[int]],
    action_masks: list[list[int]],
    *,
    context: list[Tensor] | None = None,
    framing: Framing | None = None,
    context_keys: list[Hashable] | None = None,
) -> ActionScores:
    """(N, V) logits of the rows' action tokens, each distinct (prompt, context) run once.

    `context`: per row, latents or text embeddings to splice into the first user turn (as build_batch).
    `context_keys`: per row, a hashable naming that context; required with `context`.
    """
    if context is not None and (context_keys is None or len(context_keys) != len(token_ids)):
        raise ValueError("score_actions_shared: context needs one context key per row")
    embed = model.get_input_embeddings()
    device = embed.weight.device
    group_of: dict[Hashable, int] = {}
    prompts: list[Tensor] = []  # (P_g, D) per distinct prompt
    conts, row_group, starts = [], [], []
    rows_i, cols_i, acts = [], [], []
    for b, (ids, mask) in enumerate(zip(token_ids, action_masks)):
        positions = action_positions(mask)
        first = positions[0] if positions else len(ids)
        if first < 2:
            raise ValueError("score_actions_shared: a row's first action token has no prompt before it")
        key = (None if context_keys is None else context_keys[b], tuple(ids[: first - 1]))
        if key not in group_of:  # the splice sits in the first user turn, inside the prompt: embed it once
            group_of[key] = len(prompts)
            prompts.append(embed_row(embed, ids[: first - 1], None if context is None else context[b], framing)[0])
        row_group.append(group_of[key])
        starts.append(prompts[row_group[-1]].shape[0])  # the continuation's first position
        conts.append(embed(torch.tensor(ids[first - 1 :], device=device)))  # from the token predicting `first`
        rows_i += [b] * len(positions)
        cols_i += [p - first for p in positions]
        acts += [ids[p] for p in positions]

    body = model.model
    keyword = cache_keyword(body)
    index = torch.tensor(row_group, dtype=torch.long, device=device)
    shared, prompt_mask = _prompt_cache(body, keyword, prompts, index)
    cont_emb, cont_mask = _pad(conts, max(c.shape[0] for c in conts))  # (B, C, D), (B, C)
    start = torch.tensor(starts, dtype=torch.long, device=device)
    positions = start[:, None] + torch.arange(cont_emb.shape[1], device=device)  # each row's true positions
    hidden = body(
        inputs_embeds=cont_emb,
        attention_mask=torch.cat([prompt_mask[index], cont_mask], dim=1),
        position_ids=positions,
        use_cache=True,
        **{keyword: shared},
    ).last_hidden_state  # (B, C, D)
    rows_t = torch.tensor(rows_i, dtype=torch.long, device=device)
    cols_t = torch.tensor(cols_i, dtype=torch.long, device=device)
    logits = head_logits(model, hidden[rows_t, cols_t])  # (N, V), float32 head on a bf16 model
    return ActionScores(logits, torch.tensor(acts, dtype=torch.long, device=device), rows_t, len(prompts))


def _prompt_cache(body, keyword: str, prompts: list[Tensor], index: Tensor) -> tuple[DynamicCache, Tensor]:
    """Run each distinct prompt once and give every row its prompt's KV cache (graph kept) and padding mask."""
    device = index.device
    prompt_emb, prompt_mask = _pad(prompts, max(p.shape[0] for p in prompts))  # (G, P, D), (G, P)
    cache = DynamicCache()
    body(
        inputs_embeds=prompt_emb,
        attention_mask=prompt_mask,
        position_ids=torch.arange(prompt_emb.shape[1], device=device).expand(len(prompts), -1),
        use_cache=True,
        **{keyword: cache},
    )
    shared = DynamicCache(
        ddp_cache_data=[
            (layer.keys.index_select(0, index), layer.values.index_select(0, index)) for layer in cache.layers
        ]
    )  # (B, H_kv, P, d) per layer, graph kept
    return shared, prompt_mask

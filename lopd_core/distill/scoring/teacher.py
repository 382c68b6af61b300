"""The latent teacher: the frozen base reading the student's own ids with latents spliced into the first user turn.

The student's conversation starts `<|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\n{instruction}…`. The
teacher sees the same ids with `<|exp_start|> c_1 … c_{J·K} <|exp_end|> \\n` inserted right after
`<|im_start|>user\\n` — the place where, as text, retrieved experiences sit (lopd_core/model/chat/codec.py), so the
base's warm start taught it to read that slot. A model speaking its own chat template (`TemplateChat`) has
its slot at the head of its first user turn's content too; `Framing.user_header` says where that begins in its
ids. Everything after the splice is the student's ids unchanged, so teacher log-probs
line up with the student's action tokens by a fixed shift per row; nothing is re-tokenized.

Both models are scored only at action positions: hidden states are gathered at the positions that predict an
action token before the LM head, so the (T, V) logits of forced tokens are never computed (DESIGN §7).
Shapes: B rows, T tokens, D width, N action tokens in the batch, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lopd_core.model.chat import EXP_END, EXP_START, IM_START, is_embedded_format
from lopd_core.model.head import head_logits


@dataclass(frozen=True)
class Framing:
    """Token ids that frame the latent slot, read once from the tokenizer.

    `user_header` is empty for the embedded format (the slot follows the second `<|im_start|>`'s line); for a
    model's own chat template it is the id run its first user turn's content follows (`TemplateChat`)."""

    im_start: int | None
    exp_start: int
    exp_end: int
    newline: int
    user_header: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Framing:
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        if len(newline) != 1:
            raise ValueError("the tokenizer must encode '\\n' as one token (see lopd_core/model/tokenizer.py)")
        if not is_embedded_format(tokenizer):
            from lopd_core.model.chat.template import TemplateChat

            chat = TemplateChat(tokenizer)
            return cls(
                im_start=None,
                exp_start=chat.exp_start_id,
                exp_end=chat.exp_end_id,
                newline=newline[0],
                user_header=tuple(chat.user_header),
            )
        ids = tokenizer.convert_tokens_to_ids([IM_START, EXP_START, EXP_END])
        return cls(im_start=ids[0], exp_start=ids[1], exp_end=ids[2], newline=newline[0])


def splice_position(token_ids: list[int], framing: Framing) -> int:
    """Where the first user turn's content begins: after the first `user_header` run when the framing has one,
    else right after `<|im_start|>user\\n` (the second turn's header ends at its first newline)."""
    if framing.user_header:
        header, n = list(framing.user_header), len(framing.user_header)
        for i in range(len(token_ids) - n + 1):
            if token_ids[i : i + n] == header:
                return i + n
        raise ValueError("no first user turn header in these ids")
    starts = [i for i, t in enumerate(token_ids) if t == framing.im_start]
    if len(starts) < 2:
        raise ValueError("a trajectory must begin with a system turn and a user turn")
    for i in range(starts[1] + 1, len(token_ids)):
        if token_ids[i] == framing.newline:
            return i + 1
    raise ValueError("no newline after the user turn's header")


@dataclass
class ScoringBatch:
    """Right-padded inputs of a batch plus where its action tokens are, for the student or the teacher."""

    inputs_embeds: Tensor  # (B, T, D)
    attention_mask: Tensor  # (B, T)
    predict_rows: Tensor  # (N,) row of each action token
    predict_cols: Tensor  # (N,) position whose output predicts that action token
    action_ids: Tensor  # (N,) the action tokens
    token_traj_index: Tensor  # (N,) == predict_rows, named for the losses' API


def action_positions(mask: list[int]) -> list[int]:
    return [i for i, m in enumerate(mask) if m and i > 0]


def embed_row(embed, ids: list[int], latents: Tensor | None, framing: Framing | None) -> tuple[Tensor, int]:
    """One row's input embeddings (T', D), its latents (or text-context embeddings) spliced after the user
    turn's header; and the shift, how many positions the splice inserted before the student's later ids.

    No latents (None, or zero rows: a task that retrieved nothing, a baseline without a text) means no block at
    all: the teacher then reads the plain conversation, as the chat format renders a turn without experiences
    (lopd_core/model/chat/codec.py), rather than an empty `<|exp_start|><|exp_end|>` block the base never saw."""
    device = embed.weight.device
    emb = embed(torch.tensor(ids, device=device))  # (T, D)
    if latents is None or latents.shape[0] == 0:
        return emb, 0
    at = splice_position(ids, framing)
    frame_open = embed(torch.tensor([framing.exp_start], device=device))
    frame_close = embed(torch.tensor([framing.exp_end, framing.newline], device=device))
    lat = latents.to(emb.dtype)
    return torch.cat([emb[:at], frame_open, lat, frame_close, emb[at:]], dim=0), 3 + lat.shape[0]


def build_batch(
    model,
    token_ids: list[list[int]],
    action_masks: list[list[int]],
    latents: list[Tensor] | None = None,
    framing: Framing | None = None,
) -> ScoringBatch:
    """Embed each row (splicing its latents when given) and locate its action tokens.

    Latent rows keep their autograd graph, so a loss on the teacher's outputs reaches the composer.
    """
    embed = model.get_input_embeddings()
    device = embed.weight.device
    rows, rows_i, cols_i, acts = [], [], [], []
    for b, (ids, mask) in enumerate(zip(token_ids, action_masks)):
        emb, shift = embed_row(embed, ids, None if latents is None else latents[b], framing)
        positions = action_positions(mask)
        rows.append(emb)
        rows_i += [b] * len(positions)
        cols_i += [p - 1 + shift for p in positions]  # output at p-1 predicts token p
        acts += [ids[p] for p in positions]
    width = max(r.shape[0] for r in rows)
    embeds = torch.zeros((len(rows), width, rows[0].shape[1]), dtype=rows[0].dtype, device=device)
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        embeds[b, : r.shape[0]] = r
        attention[b, : r.shape[0]] = 1
    rows_t = torch.tensor(rows_i, dtype=torch.long, device=device)
    return ScoringBatch(
        embeds,
        attention,
        rows_t,
        torch.tensor(cols_i, dtype=torch.long, device=device),
        torch.tensor(acts, dtype=torch.long, device=device),
        rows_t,
    )


def action_logits(model, batch: ScoringBatch) -> Tensor:
    """(N, V) logits at the positions that predict the batch's action tokens (float32)."""
    hidden = model.model(inputs_embeds=batch.inputs_embeds, attention_mask=batch.attention_mask).last_hidden_state
    return head_logits(model, hidden[batch.predict_rows, batch.predict_cols])  # float32 head on a bf16 model

"""The composer's reading term during distillation: φ keeps reading the bank as the text does.

The in-world fit (world_fit.py) reads φ into the bank as it stands before a stage; the bank then grows within the
stage (growing_bank.py) and the paper's composer loss — KL to the old student plus the margin — says nothing about
how well new rows are read. So beside the margin the composer's online loss keeps the fit's objective, weighted:

    loss_φ += w · KL(p_text ‖ p_latent)   at the action tokens of a few of the step's own trajectories,

the frozen teacher reading each row's retrieved experiences as φ's latents (graph to φ) against the same teacher
reading them as plain text (no graph). The rows are the first sample of each task, at most `lopd.text_kl_rows`:
one extra no-grad pass and one pass with a graph per step, bounded whatever the batch. `lopd.text_kl_weight` 0
turns it off (the paper's loss); it acts only where φ trains. The reference update (reference.py) and the
optimised one (update.py) both compute it here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch


def reading_rows(n_rows: int, samples_per_task: int, limit: int) -> list[int]:
    """The trajectories the term reads: the first sample of each task, at most `limit`."""
    return list(range(0, n_rows, samples_per_task))[:limit]


def text_embeddings(lm, tokenizer, texts: list[list[str]], rooms: list[int] | None = None) -> list[Tensor]:
    """Each row's experiences as text, joined as the chat format joins them, cut to `rooms[i]` tokens when given
    (what fits beside the row within rollout.max_context); no grad. The cold start and the fit read them whole."""
    embed = lm.get_input_embeddings()
    out = []
    with torch.no_grad():
        for k, row in enumerate(texts):
            ids = tokenizer("\n".join(row), add_special_tokens=False)["input_ids"] if row else []
            ids = ids if rooms is None else ids[: max(rooms[k], 0)]
            out.append(embed(torch.tensor(ids, dtype=torch.long, device=embed.weight.device)))
    return out


def reading_kl(
    lm,
    ids: list[list[int]],
    masks: list[list[int]],
    latents: list[Tensor],
    texts: list[list[str]],
    *,
    tokenizer,
    framing: Framing,
    max_context: int,
) -> tuple[Tensor, int]:
    """Σ over the rows' action tokens of KL(p_text ‖ p_latent) (graph to `latents`) and how many tokens that is.
    A row that retrieved nothing reads the plain conversation both ways and adds 0."""
    lat_logits = action_logits(lm, build_batch(lm, ids, masks, latents, framing))  # (N, V)
    rooms = [max_context - len(row) - 3 for row in ids]
    with torch.no_grad():
        txt_batch = build_batch(lm, ids, masks, text_embeddings(lm, tokenizer, texts, rooms), framing)
        txt_logits = action_logits(lm, txt_batch)
    return L.forward_kl_full(lat_logits, txt_logits).sum(), int(txt_batch.action_ids.numel())

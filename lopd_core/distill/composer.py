"""The composer φ: retrieved experiences -> continuous latent tokens for the teacher's input.

Each experience text is read by the frozen base (last-layer hidden states, no gradient; cached per text, since
the same bank rows are retrieved again and again). A Perceiver/Q-Former resampler with K learned queries
cross-attends to one experience's states and writes K vectors; the J experiences of a task give J·K latents.
The output is projected to the LM's embedding width and rescaled to the mean norm of the token embeddings, so
the frozen teacher reads latents of the same scale as the token embeddings it was trained on.

Departures from the official code: the optional encoder LoRA is not implemented (the frozen encoder's states
are cached instead); the resampler's width is its own setting (`hidden_size`, 0 = the LM's width), projected
in and out, so a large LM does not force a large composer. Shapes: E experiences, L experience tokens,
K queries, D LM width, C composer width.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn


class ResamplerBlock(nn.Module):
    """Queries cross-attend to the experience states, then self-attend, then an MLP (pre-norm residuals)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm_q, self.norm_kv = nn.LayerNorm(width), nn.LayerNorm(width)
        self.cross = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm_self = nn.LayerNorm(width)
        self.self_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm_mlp = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, queries: Tensor, states: Tensor, pad_mask: Tensor) -> Tensor:
        kv = self.norm_kv(states)
        q = self.norm_q(queries)
        queries = queries + self.cross(q, kv, kv, key_padding_mask=pad_mask, need_weights=False)[0]
        q = self.norm_self(queries)
        queries = queries + self.self_attn(q, q, q, need_weights=False)[0]
        return queries + self.mlp(self.norm_mlp(queries))


class Composer(nn.Module):
    def __init__(
        self,
        lm_width: int,
        *,
        num_queries: int = 32,
        hidden_size: int = 0,
        num_layers: int = 2,
        num_heads: int = 4,
        embedding_norm: float = 1.0,
    ):
        super().__init__()
        width = hidden_size or lm_width
        self.num_queries = num_queries
        self.queries = nn.Parameter(torch.randn(num_queries, width) * 0.02)  # (K, C)
        self.proj_in = nn.Linear(lm_width, width) if width != lm_width else nn.Identity()
        self.blocks = nn.ModuleList(ResamplerBlock(width, num_heads) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(width)
        self.proj_out = nn.Linear(width, lm_width)
        self.register_buffer("embedding_norm", torch.tensor(float(embedding_norm)))

    def forward(self, states: Tensor, state_mask: Tensor) -> Tensor:
        """states (E, L, D) and state_mask (E, L; 1 = real token) -> latents (E, K, D) at the embedding norm."""
        x = self.proj_in(states.to(self.queries.dtype))  # (E, L, C)
        q = self.queries.unsqueeze(0).expand(states.shape[0], -1, -1)  # (E, K, C)
        pad = state_mask == 0
        for block in self.blocks:
            q = block(q, x, pad)
        out = self.proj_out(self.norm_out(q))  # (E, K, D)
        return out / out.norm(dim=-1, keepdim=True).clamp(min=1e-6) * self.embedding_norm


def mean_embedding_norm(model) -> float:
    """Mean L2 norm of the LM's input-embedding rows: the scale latents are given."""
    return float(model.get_input_embeddings().weight.detach().float().norm(dim=-1).mean())


class ExperienceEncoder:
    """Frozen last-layer states of experience texts, cached by content (the base never changes during a run).

    The cache holds CPU tensors keyed by a hash of the text, so it survives across steps and can be reused by
    cold start and distillation alike.
    """

    def __init__(self, teacher_view, tokenizer, *, max_tokens: int = 256, batch_size: int = 16):
        self.view, self.tokenizer = teacher_view, tokenizer  # lopd_core.distill.models.TeacherView
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.cache: dict[str, Tensor] = {}
        self.hits = self.misses = 0

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()

    @torch.no_grad()
    def _encode_missing(self, texts: list[str]) -> None:
        with self.view.active() as base:
            self._encode_with(base, texts)

    def _encode_with(self, base, texts: list[str]) -> None:
        device = next(base.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_tokens] or [0] for t in chunk]
            width = max(len(i) for i in ids)
            batch = torch.zeros((len(ids), width), dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for row, seq in enumerate(ids):
                batch[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            hidden = base.model(input_ids=batch.to(device), attention_mask=mask.to(device)).last_hidden_state
            for row, (text, seq) in enumerate(zip(chunk, ids)):
                self.cache[self.key(text)] = hidden[row, : len(seq)].float().cpu()

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """(E, L, D) states right-padded with zeros and (E, L) mask, for E texts."""
        missing = list(dict.fromkeys(t for t in texts if self.key(t) not in self.cache))
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        if missing:
            self._encode_missing(missing)
        states = [self.cache[self.key(t)] for t in texts]
        width = max(s.shape[0] for s in states)
        out = torch.zeros((len(states), width, states[0].shape[1]))
        mask = torch.zeros((len(states), width), dtype=torch.long)
        for row, s in enumerate(states):
            out[row, : s.shape[0]] = s
            mask[row, : s.shape[0]] = 1
        return out, mask


def compose_latents(composer: Composer, encoder: ExperienceEncoder, experiences: list[list[str]]) -> list[Tensor]:
    """Latents per task: the J experiences of task b give a (J·K, D) tensor (empty (0, D) with none)."""
    flat = [text for texts in experiences for text in texts]
    device = composer.queries.device
    width = composer.proj_out.out_features
    if not flat:
        return [torch.zeros((0, width), device=device) for _ in experiences]
    states, mask = encoder.encode(flat)
    latents = composer(states.to(device), mask.to(device))  # (E, K, D)
    out, start = [], 0
    for texts in experiences:
        out.append(latents[start : start + len(texts)].reshape(-1, width))  # (J·K, D)
        start += len(texts)
    return out

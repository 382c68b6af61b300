"""The composer φ: retrieved experiences -> continuous latent tokens for the teacher's input.

Each experience text is read by the frozen base (last-layer hidden states, no gradient; cached per text, since
the same bank rows are retrieved again and again). A Perceiver/Q-Former resampler with K learned queries
cross-attends to one experience's states and writes K vectors; the J experiences of a task give J·K latents.
The output is projected to the LM's embedding width and rescaled to the mean norm of the token embeddings, so
the frozen teacher reads latents of the same scale as the token embeddings it was trained on.

Two of the official composer's choices are options here, each behind a setting (docs/composer.md has their
figures): `composer.query_conditioned` encodes each experience with the current task's instruction in front of
it, so the states (and the latents) depend on the query; `composer.encoder_lora_rank` reads with a LoRA of the
base that belongs to φ (encoder_lora.py). Both are recorded in φ's saved state, so a φ is always read the way it
was fitted. The resampler's width is its own setting (`hidden_size`, 0 = the LM's width), projected in and out,
so a large LM does not force a large composer. Shapes: E experiences, L experience tokens, K queries, D LM
width, C composer width.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from lopd_core.distill.encoder_lora import EncoderLoRA


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
        query_conditioned: bool = False,
        encoder_lora: EncoderLoRA | None = None,
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
        # how φ reads: saved with its weights, so a fitted φ cannot be read another way by accident
        self.register_buffer("query_conditioned", torch.tensor(bool(query_conditioned)))
        self.encoder_lora = encoder_lora

    @property
    def reads_query(self) -> bool:
        """Whether each experience is encoded with its task's instruction in front of it."""
        return bool(self.query_conditioned)

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

    The cache holds CPU tensors keyed by a hash of the text (and of the task's instruction in front of it, for a
    query-conditioned composer), so it survives across steps and can be reused by cold start and distillation
    alike. Read through an encoder LoRA that is training (the cold start, the fit), states are computed afresh
    with their graph and never cached; a fixed LoRA's states are cached like the base's (one LoRA per encoder:
    distillation keeps φ's LoRA fixed, and φ0's is the same).
    """

    def __init__(self, teacher_view, tokenizer, *, max_tokens: int = 256, batch_size: int = 16):
        self.view, self.tokenizer = teacher_view, tokenizer  # lopd_core.distill.models.TeacherView
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.cache: dict[str, Tensor] = {}
        self.hits = self.misses = 0

    @staticmethod
    def key(text: str, query: str = "") -> str:
        return hashlib.sha1((f"{query}\x00{text}" if query else text).encode()).hexdigest()

    def _ids(self, text: str, query: str) -> tuple[list[int], int]:
        """The encoder's input for one experience and where its own tokens start (after the query, if any)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_tokens] or [0]
        if not query:
            return ids, 0
        prefix = self.tokenizer(f"{query}\n", add_special_tokens=False)["input_ids"][: self.max_tokens]
        return prefix + ids, len(prefix)

    def _states(self, base, pairs: list[tuple[str, str]]) -> list[Tensor]:
        """(L_i, D) states of each (text, query)'s own tokens, read by `base` in batches (graph kept if enabled)."""
        device = next(base.parameters()).device
        out = []
        for start in range(0, len(pairs), self.batch_size):
            inputs = [self._ids(text, query) for text, query in pairs[start : start + self.batch_size]]
            width = max(len(ids) for ids, _ in inputs)
            batch = torch.zeros((len(inputs), width), dtype=torch.long)
            mask = torch.zeros((len(inputs), width), dtype=torch.long)
            for row, (ids, _) in enumerate(inputs):
                batch[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            hidden = base.model(input_ids=batch.to(device), attention_mask=mask.to(device)).last_hidden_state
            out.extend(hidden[row, skip : len(ids)].float() for row, (ids, skip) in enumerate(inputs))
        return out

    def _read(self, pairs: list[tuple[str, str]], lora: EncoderLoRA | None) -> list[Tensor]:
        with self.view.active() as base, lora.applied(base) if lora is not None else nullcontext():
            return self._states(base, pairs)

    @torch.no_grad()
    def _encode_missing(self, pairs: list[tuple[str, str]], lora: EncoderLoRA | None = None) -> None:
        for (text, query), states in zip(pairs, self._read(pairs, lora)):
            self.cache[self.key(text, query)] = states.cpu()

    def encode(
        self, texts: list[str], queries: list[str] | None = None, lora: EncoderLoRA | None = None
    ) -> tuple[Tensor, Tensor]:
        """(E, L, D) states right-padded with zeros and (E, L) mask, for E texts (each read with its query in
        front when `queries` is given, and through `lora` when given)."""
        pairs = list(zip(texts, queries if queries is not None else [""] * len(texts)))
        if lora is not None and lora.trains():
            states = self._read(pairs, lora)  # φ's encoder is learning: fresh, with the graph to its LoRA
        else:
            missing = list(dict.fromkeys(p for p in pairs if self.key(*p) not in self.cache))
            self.misses += len(missing)
            self.hits += len(pairs) - len(missing)
            if missing:
                self._encode_missing(missing, lora)
            states = [self.cache[self.key(*p)] for p in pairs]
        return pad_states(states)


def pad_states(states: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad (L_i, D) states to (E, L, D) with an (E, L) mask of real tokens."""
    width = max(s.shape[0] for s in states)
    out = states[0].new_zeros((len(states), width, states[0].shape[1]))
    mask = torch.zeros((len(states), width), dtype=torch.long)
    for row, s in enumerate(states):
        out[row, : s.shape[0]] = s
        mask[row, : s.shape[0]] = 1
    return out, mask


def compose_latents(
    composer: Composer, encoder: ExperienceEncoder, experiences: list[list[str]], queries: list[str] | None = None
) -> list[Tensor]:
    """Latents per task: the J experiences of task b give a (J·K, D) tensor (empty (0, D) with none).
    `queries`: each task's instruction, which a query-conditioned composer reads in front of its experiences."""
    flat = [text for texts in experiences for text in texts]
    device = composer.queries.device
    width = composer.proj_out.out_features
    if not flat:
        return [torch.zeros((0, width), device=device) for _ in experiences]
    states, mask = encoder.encode(flat, flat_queries(composer, experiences, queries), lora=composer.encoder_lora)
    latents = composer(states.to(device), mask.to(device))  # (E, K, D)
    out, start = [], 0
    for texts in experiences:
        out.append(latents[start : start + len(texts)].reshape(-1, width))  # (J·K, D)
        start += len(texts)
    return out


def flat_queries(composer: Composer, experiences: list[list[str]], queries: list[str] | None) -> list[str] | None:
    """One query per experience, as `experiences` flattened; None for a composer that reads no query."""
    if not composer.reads_query:
        return None
    if queries is None or len(queries) != len(experiences):
        raise ValueError(
            "this composer reads each experience with its task's instruction in front (composer.query_conditioned): "
            "pass one query per task"
        )
    return [q for q, texts in zip(queries, experiences) for _ in texts]


def build_composer(cfg, model) -> Composer:
    """A fresh φ of the `composer` section's shape (`cfg`, lopd_core.settings ComposerConfig) for `model`."""
    return Composer(
        model.config.hidden_size,
        num_queries=cfg.num_queries,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        embedding_norm=mean_embedding_norm(model),
        query_conditioned=cfg.query_conditioned,
        encoder_lora=EncoderLoRA.for_model(model, cfg.encoder_lora_rank) if cfg.encoder_lora_rank else None,
    )


def load_weights(composer: Composer, path, *, refit: bool = False) -> None:
    """φ's saved state into `composer`; a φ fitted to read another way than the settings say is refused (its
    latents would mean something else) unless `refit`: the start of a fit, which teaches it the new reading."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        state.setdefault("query_conditioned", torch.tensor(False))  # a φ saved before the option read no query
        if refit:
            state["query_conditioned"] = torch.tensor(composer.reads_query)
        if composer.encoder_lora is not None and not any(k.startswith("encoder_lora.") for k in state):
            # a φ fitted without an encoder LoRA (φ0) starts one at zero: it reads exactly as it did
            state.update({f"encoder_lora.{k}": v for k, v in composer.encoder_lora.state_dict().items()})
    wanted = composer.reads_query
    composer.load_state_dict(state)
    if composer.reads_query != wanted:
        raise ValueError(
            f"fitted with composer.query_conditioned={composer.reads_query}, the settings say {wanted}: "
            "refit it (`lopd coldstart`, `lopd fit`) or change the setting"
        )

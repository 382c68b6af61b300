"""The composer φ: retrieved experiences -> continuous latent tokens for the teacher's input.

Each experience text is read by the frozen base (last-layer hidden states, no gradient; cached per text, since
the same bank rows are retrieved again and again). A Perceiver/Q-Former resampler with K learned queries
cross-attends to one experience's states and writes K vectors; the J experiences of a task give J·K latents.
The output is projected to the LM's embedding width and rescaled to the mean norm of the token embeddings, so
the frozen teacher reads latents of the same scale as the token embeddings it was trained on.

Two of the official composer's choices are options here, each behind a setting (docs/composer.md has their
figures): `composer.query_conditioned` encodes each experience with the current task's instruction in front of
it, so the states (and the latents) depend on the query; `composer.encoder_lora_rank` reads with a LoRA of the
base that belongs to φ (encoder_lora.py). Both are part of φ's configuration (`PhiConfig`: its shape and how it
reads), which `save_composer` writes as JSON beside the weights (as PEFT's adapter_config.json) and `load_weights`
checks against the settings, naming the field that differs, so a φ is always read the way it was fitted. The
resampler's width is its own setting (`hidden_size`, 0 = the LM's width), projected in and out,
so a large LM does not force a large composer. Shapes: E experiences, L experience tokens, K queries, D LM
width, C composer width.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from lopd_core.distill.composer.encoder_lora import EncoderLoRA, lora_fingerprint
from lopd_core.distill.composer.lru import DEFAULT_CAPACITY, LRUCache
from lopd_core.outputs import atomic_write, write_file


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


@dataclass(frozen=True)
class PhiConfig:
    """φ's configuration: its shape and how it reads. Saved as JSON beside its weights (`save_composer`) and checked
    on load (`load_weights`): weights of the same shapes read another way (other heads, the query in front or not)
    would load without a complaint and mean something else."""

    lm_width: int  # D: the LM's hidden size, the latents' width
    num_queries: int  # K: latents per experience
    width: int  # C: the resampler's width (composer.hidden_size; 0 there is D)
    num_layers: int
    num_heads: int
    query_conditioned: bool  # each experience read with its task's instruction in front
    encoder_lora_rank: int  # 0: the encoder reads the frozen base's states
    encoder_lora_scale: float  # the LoRA's α / r (0.0 without one)


# Where each field of PhiConfig comes from, for the error that names a mismatch.
PHI_CONFIG_SOURCES = {
    "lm_width": "the model's hidden_size",
    "num_queries": "composer.num_queries",
    "width": "composer.hidden_size (0: the model's hidden_size)",
    "num_layers": "composer.num_layers",
    "num_heads": "composer.num_heads",
    "query_conditioned": "composer.query_conditioned",
    "encoder_lora_rank": "composer.encoder_lora_rank",
    "encoder_lora_scale": "the encoder LoRA's scale α / r",
}


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
        self.register_buffer("embedding_norm", torch.tensor(float(embedding_norm)))  # of the base: a measure
        self.encoder_lora = encoder_lora
        self.config = PhiConfig(
            lm_width=lm_width,
            num_queries=num_queries,
            width=width,
            num_layers=num_layers,
            num_heads=num_heads,
            query_conditioned=bool(query_conditioned),
            encoder_lora_rank=encoder_lora.rank if encoder_lora is not None else 0,
            encoder_lora_scale=float(encoder_lora.scale) if encoder_lora is not None else 0.0,
        )

    @property
    def reads_query(self) -> bool:
        """Whether each experience is encoded with its task's instruction in front of it."""
        return self.config.query_conditioned

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
    """Frozen last-layer states of experience texts, cached by content (the base never changes during a run; a
    teacher refresh that replaces it clears the cache).

    The cache holds CPU tensors keyed by a hash of the text, of the task's instruction in front of it (for a
    query-conditioned composer) and of the encoder LoRA's weights (encoder_lora.py, `fingerprint`), so it
    survives across steps, can be reused by cold start and distillation alike, and never serves states read
    under other LoRA weights. It is bounded (lru.py: the least recently used encoding goes first). Read through
    an encoder LoRA that is training (the cold start, the fit), states are computed afresh with their graph and
    never cached.
    """

    def __init__(
        self,
        teacher_view,
        tokenizer,
        *,
        max_tokens: int = 256,
        batch_size: int = 16,
        cache_capacity: int = DEFAULT_CAPACITY,
    ):
        self.view, self.tokenizer = teacher_view, tokenizer  # lopd_core.distill.scoring.models.TeacherView
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.cache: LRUCache[str, Tensor] = LRUCache(cache_capacity)
        self.hits = self.misses = 0

    @staticmethod
    def key(text: str, query: str = "", lora: str = "") -> str:
        """The cache key of `text` read with `query` in front, through the LoRA of fingerprint `lora` ("": none)."""
        parts = (f"{query}\x00{text}" if query else text) + (f"\x00lora:{lora}" if lora else "")
        return hashlib.sha1(parts.encode()).hexdigest()

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
    def _encode_missing(self, pairs: list[tuple[str, str]], lora: EncoderLoRA | None) -> dict[str, Tensor]:
        """The states of `pairs`, read and cached, by key."""
        fingerprint = lora_fingerprint(lora)
        fresh = {self.key(t, q, fingerprint): states.cpu() for (t, q), states in zip(pairs, self._read(pairs, lora))}
        for key, states in fresh.items():
            self.cache.put(key, states)
        return fresh

    def encode(
        self, texts: list[str], queries: list[str] | None = None, lora: EncoderLoRA | None = None
    ) -> tuple[Tensor, Tensor]:
        """(E, L, D) states right-padded with zeros and (E, L) mask, for E texts (each read with its query in
        front when `queries` is given, and through `lora` when given)."""
        pairs = list(zip(texts, queries if queries is not None else [""] * len(texts)))
        if lora is not None and lora.trains():
            states = self._read(pairs, lora)  # φ's encoder is learning: fresh, with the graph to its LoRA
        else:
            fingerprint = lora_fingerprint(lora)
            keys = [self.key(text, query, fingerprint) for text, query in pairs]
            # this call's states held apart from the cache: one call may read more texts than the cache keeps
            found = {k: v for k in dict.fromkeys(keys) if (v := self.cache.get(k)) is not None}
            missing = list(dict.fromkeys(p for p, k in zip(pairs, keys) if k not in found))
            self.misses += len(missing)
            self.hits += len(pairs) - len(missing)
            if missing:
                found.update(self._encode_missing(missing, lora))
            states = [found[k] for k in keys]
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


def config_path(path: str | Path) -> Path:
    """Where φ's configuration lies beside its weights: phi0.pt -> phi0.config.json."""
    path = Path(path)
    return path.with_name(f"{path.stem}.config.json")


def save_composer(composer: Composer, path: str | Path) -> Path:
    """φ's weights at `path` and its configuration as JSON beside them (`config_path`), each written atomically;
    the configuration first, so weights on disk always have theirs."""
    write_file(config_path(path), json.dumps(asdict(composer.config), indent=2) + "\n")
    with atomic_write(path) as f:
        torch.save(composer.state_dict(), f)
    return Path(path)


def saved_config(path: str | Path) -> PhiConfig:
    """The configuration saved beside the φ at `path`. A φ without one (saved before configurations were
    recorded) is refused, not guessed at: its weights do not say how many heads it attends with."""
    where = config_path(path)
    if not where.is_file():
        raise ValueError(
            f"no {where.name} beside it: a φ saved before its configuration was recorded beside its weights, "
            "whose reading cannot be checked; rebuild it (`lopd coldstart`, `lopd fit`)"
        )
    try:
        saved = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where.name}: unreadable ({exc})") from None
    names = [f.name for f in fields(PhiConfig)]
    if not isinstance(saved, dict) or set(saved) != set(names):
        got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where.name}: expected the fields {names}, got {got}")
    return PhiConfig(**saved)


def check_config(saved: PhiConfig, composer: Composer, *, refit: bool = False) -> None:
    """Refuse to read a φ saved as `saved` into `composer` (built from the settings) where a field differs, naming
    the first one. Two differences are allowed: a φ without an encoder LoRA into one with a LoRA (the LoRA starts
    at zero, so it reads exactly as fitted), and with `refit`, another query_conditioned (the start of a fit,
    which teaches it the new reading)."""
    wanted = composer.config
    allowed = set()
    if saved.encoder_lora_rank == 0:
        allowed |= {"encoder_lora_rank", "encoder_lora_scale"}
    if refit:
        allowed.add("query_conditioned")
    for name in (f.name for f in fields(PhiConfig)):
        had, want = getattr(saved, name), getattr(wanted, name)
        if had != want and name not in allowed:
            raise ValueError(
                f"{name}: fitted with {had}, the settings give {want} (from {PHI_CONFIG_SOURCES[name]}): "
                "refit it (`lopd coldstart`, `lopd fit`) or change the setting"
            )


def load_weights(composer: Composer, path, *, refit: bool = False) -> None:
    """φ's saved weights into `composer`, after its saved configuration is checked against `composer`'s
    (`check_config`: a φ fitted to another shape or reading is refused, its latents would mean something else)."""
    saved = saved_config(path)
    check_config(saved, composer, refit=refit)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and composer.encoder_lora is not None and saved.encoder_lora_rank == 0:
        # a φ fitted without an encoder LoRA (φ0) starts one at zero (B = 0): it reads exactly as it did
        lora = composer.encoder_lora.state_dict()
        state.update({f"encoder_lora.{k}": torch.zeros_like(v) if k.startswith("b.") else v for k, v in lora.items()})
    composer.load_state_dict(state)

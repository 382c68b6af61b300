"""`lopd coldstart`: train φ0, a composer whose latents make the frozen base reproduce oracle successes.

The successes are oracle episodes on training tasks of the *pretraining* worlds, retrieved from a bank of their
own (coldstart_data.py), never the deployment bank. For a successful trajectory τ of task x and the J
experiences retrieved for x (never τ's own task, so φ0 must carry what *other* successes know rather than copy
the answer):
  * NLL — the paper's objective: −mean log p_base(a | latents c_φ, student ids) over τ's action tokens;
  * KL — our addition, after xRAG: KL(p_base+text ‖ p_base+latents) at the same positions, where the first is
    the same frozen base reading the experiences as plain text between the same framing tokens: the forward KL
    from the latent reader toward the text reader. It pulls the latents toward meaning what the text means, and
    costs one extra no-grad forward.
loss = NLL + kl_weight · KL, both token means. Logged per step with the latent/embedding norm ratio. A step
whose loss or gradient norm is not finite is skipped, counted and logged (`ColdstartRun.skipped_updates`).

Under `accelerate launch` every rank draws the same batch and trains on its slice of it; both means are divided
by the batch's global token count and the gradients summed over ranks (lopd_core/distributed.py), so the
composer takes the 1-process step on every rank.
"""

from __future__ import annotations

import csv
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.distill.composer.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.distill.composer.reading import text_embeddings
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.models import TeacherView, freeze
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch

COLDSTART_COLUMNS = ["step", "nll", "kl", "loss", "latent_norm_ratio", "grad_norm", "step_seconds"]


@dataclass
class ColdstartRun:
    """What a cold start returns: its rows (COLDSTART_COLUMNS) and how many updates it skipped as non-finite."""

    rows: list[dict]
    skipped_updates: int = 0


def train_coldstart(
    base,
    tokenizer,
    composer: Composer,
    successes: list,
    retriever,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    kl_weight: float,
    seed: int,
    csv_path: str | Path | None = None,
    max_experience_tokens: int = 256,
    sharding: str = "none",
    nll_weight: float = 1.0,
    label: str = "coldstart",
    log=print,
) -> ColdstartRun:
    """`successes`: oracle trajectories (token_ids, action_mask, task) of the pretraining worlds; `retriever(tasks)`
    gives experience texts per task, excluding the task itself. Trains `composer` in place. `sharding: fsdp2`
    shards the frozen base between steps (lopd_core/sharding.py; the composer stays replicated). `nll_weight` 0
    with `kl_weight` > 0 is the in-world fit (world_fit.py): the targets are the policy's own samples, failures
    among them, so their tokens are read, never imitated; the NLL is still logged. `label` names the progress
    lines."""
    if not successes:
        raise ValueError(f"{label}: needs at least one target trajectory")
    D.setup()
    if D.world_size() > min(batch_size, len(successes)):
        raise ValueError(
            f"coldstart.batch_size: got {batch_size} ({len(successes)} successes), expected at "
            f"least the number of processes ({D.world_size()})"
        )
    log = log if D.is_main() else (lambda *_a, **_k: None)
    reader, shards = _frozen_reader(base, tokenizer, max_experience_tokens, sharding)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(composer.parameters(), lr=lr, weight_decay=0.0)
    composer.train()
    run = ColdstartRun([])
    for step in range(1, steps + 1):
        started = time.perf_counter()
        batch = rng.sample(successes, min(batch_size, len(successes)))  # the same draw on every rank
        mine = D.shard_range(len(batch))
        with shards.gathered():  # each rank encodes and reads its own experiences: passes differ per rank
            mine_batch = batch[mine.start : mine.stop]
            row, applied = _coldstart_step(
                reader, composer, opt, mine_batch, retriever, kl_weight=kl_weight, nll_weight=nll_weight
            )
        row = {"step": step, **row, "step_seconds": time.perf_counter() - started}
        _record(run, row, applied, steps, log=log, label=label)
    if run.skipped_updates:
        log(f"{label}: {run.skipped_updates} of {steps} updates skipped as non-finite")
    if csv_path is not None and D.is_main():
        _write_csv(Path(csv_path), run.rows)
    return run


def _frozen_reader(base, tokenizer, max_experience_tokens: int, sharding: str):
    """The frozen base as the cold start reads it, and its shards under `sharding: fsdp2` (frozen: read like a
    teacher, never stepped)."""
    freeze(base)
    reader = _Reader(
        base,
        tokenizer,
        Framing.from_tokenizer(tokenizer),
        ExperienceEncoder(TeacherView(base), tokenizer, max_tokens=max_experience_tokens),
        mean_embedding_norm(base),
    )
    if sharding != "fsdp2":
        return reader, SH.Sharding([])
    SH.setup()
    return reader, SH.Sharding([], SH.shard_lm(base))


def _record(run: ColdstartRun, row: dict, applied: bool, steps: int, *, log, label: str = "coldstart") -> None:
    """Keep a step's row; count and say a skipped (non-finite) update; print progress every ten steps."""
    run.rows.append(row)
    step = row["step"]
    if not applied:
        run.skipped_updates += 1
        log(
            f"{label}: step {step}: non-finite loss/gradient (loss {row['loss']}, gradient norm "
            f"{row['grad_norm']}), update skipped ({run.skipped_updates} so far)"
        )
    if step % 10 == 0 or step == steps or step == 1:
        log(
            f"{label}: step {step}/{steps} nll {row['nll']:.4f} kl {row['kl']:.4f} "
            f"latent/embedding norm {row['latent_norm_ratio']:.2f}"
        )


@dataclass
class _Reader:
    """The frozen base as the cold start reads it: with latents, or with the experiences as text."""

    base: object
    tokenizer: object
    framing: Framing
    encoder: ExperienceEncoder
    embedding_norm: float


def _coldstart_step(
    reader: _Reader, composer: Composer, opt, batch: list, retriever, *, kl_weight: float, nll_weight: float = 1.0
) -> tuple[dict, bool]:
    """One update on this rank's share of a batch; returns the row's figures and whether the step was applied."""
    base = reader.base
    ids, masks = [t.token_ids for t in batch], [t.action_mask for t in batch]
    experiences = retriever([t.task for t in batch])
    latents = compose_latents(composer, reader.encoder, experiences, [t.task.instruction for t in batch])
    lat_batch = build_batch(base, ids, masks, latents, reader.framing)
    lat_logits = action_logits(base, lat_batch)  # (N, V), graph to φ
    n_tokens = max(D.global_sum([lat_batch.action_ids.numel()])[0], 1)  # the whole batch's, over ranks
    nll = torch.nn.functional.cross_entropy(lat_logits, lat_batch.action_ids, reduction="sum") / n_tokens
    if kl_weight > 0:
        with torch.no_grad():
            txt_batch = build_batch(
                base, ids, masks, text_embeddings(base, reader.tokenizer, experiences), reader.framing
            )
            txt_logits = action_logits(base, txt_batch)
        kl = L.forward_kl_full(lat_logits, txt_logits).sum() / n_tokens  # KL(p_text ‖ p_latent), into φ
    else:
        kl = torch.zeros(())
    loss = nll_weight * nll + kl_weight * kl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    D.sum_gradients(composer.parameters())
    nll_v, kl_v, loss_v = D.global_sum([float(nll.detach()), float(kl.detach()), float(loss.detach())])
    grad = float(torch.nn.utils.clip_grad_norm_(composer.parameters(), 1.0))
    applied = math.isfinite(loss_v) and math.isfinite(grad)
    if applied:
        opt.step()
    flat = torch.cat(latents).detach()
    norm_sum, norm_rows = D.global_sum([float(flat.norm(dim=-1).sum()), flat.shape[0]])
    ratio = norm_sum / norm_rows / reader.embedding_norm if norm_rows else 0.0
    return {"nll": nll_v, "kl": kl_v, "loss": loss_v, "latent_norm_ratio": ratio, "grad_norm": grad}, applied


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLDSTART_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

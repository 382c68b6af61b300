"""The warm start of the embedded base: batches, loss, optimizers, schedule and the training loop
(lopd_core/model/base_build.py builds the base around it).

The warm start is next-token cross-entropy on the demonstrations' action tokens only (the forced system, user
and observation tokens are context, not targets), averaged over action tokens in the batch. Batches are packed
by token budget from length-sorted demonstrations so padding stays small; the schedule is linear warm-up then
cosine decay. The layers' weight matrices take Muon steps and the embedding and norms AdamW steps
(`make_optimizers`): per step, Muon roughly doubles what the base learns, which is what a fixed budget needs.
`max_steps` > 0 (the default params) runs exactly that many steps whatever the time, so every machine builds
the same base from the same seed and a recorded figure can be rerun anywhere; `epochs` and `time_budget_s` are
then not read. With `max_steps` 0 the schedule is planned for `epochs` passes and training stops at
`time_budget_s`, even mid-epoch, fitted to the steps the machine affords: a fixed wall-clock build, but a
slower machine then gets fewer steps and a weaker base.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from lopd_core.model.chat import TrajectoryIds
from lopd_core.model.muon import StackedMuon


def pack_batches(seqs: list[TrajectoryIds], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar length whose padded size stays under batch_tokens; shuffled batch order."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, current, width = [], [], 0
    for i in order:
        new_width = max(width, len(seqs[i]))
        if current and new_width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, new_width = [], len(seqs[i])
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def first_action(seq: TrajectoryIds) -> TrajectoryIds:
    """The demonstration cut after its first action: a short sequence whose target mostly reads the instruction."""
    ids, mask = seq.token_ids, seq.action_mask
    first = mask.index(1) if 1 in mask else len(ids)
    end = next((i for i in range(first, len(ids)) if not mask[i]), len(ids))
    return TrajectoryIds(list(ids[:end]), list(mask[:end]), list(seq.sample_logprobs[:end]))


def value_tokens(tokenizer) -> torch.Tensor:
    """(V,) bool: the ids whose text is a word or a number (names, ids, amounts, tool names), not framing."""
    import re

    word = re.compile(r"[A-Za-z0-9_]+")
    special = set(tokenizer.all_special_ids)
    flags = torch.zeros(len(tokenizer), dtype=torch.bool)
    for token, index in tokenizer.get_vocab().items():
        if index not in special and word.fullmatch(tokenizer.convert_tokens_to_string([token]).strip()):
            flags[index] = True
    return flags


def copy_targets(seq: TrajectoryIds, is_value: torch.Tensor | None) -> list[bool]:
    """Per position: an action token that is a value already seen in the forced context before it (an id from an
    observation, an amount or a name from the instruction) — a copy the policy must get right."""
    seen, out = set(), []
    for token, action in zip(seq.token_ids, seq.action_mask):
        out.append(bool(action) and token in seen)
        if not action and is_value is not None and bool(is_value[token]):
            seen.add(token)
    return out


def collate(seqs: list[TrajectoryIds], pad_id: int, is_value: torch.Tensor | None = None, copy_weight: float = 1.0):
    """Right-padded (B, T) ids, attention mask, labels (-100 wherever the token is not the policy's) and loss
    weights per position (`copy_weight` on copies of context values, 1 on every other action token)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    weights = torch.ones((len(seqs), width))
    for row, s in enumerate(seqs):
        n = len(s)
        ids[row, :n] = torch.tensor(s.token_ids)
        attention[row, :n] = 1
        mask = torch.tensor(s.action_mask, dtype=torch.bool)
        labels[row, :n] = torch.where(mask, ids[row, :n], torch.tensor(-100))
        if copy_weight != 1.0 and is_value is not None:
            weights[row, :n] = torch.where(torch.tensor(copy_targets(s, is_value)), copy_weight, 1.0)
    return ids, attention, labels, weights


def action_token_loss(
    model,
    ids,
    attention,
    labels,
    context_weight: float = 0.0,
    context_fraction: float = 1.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over action tokens (weighted by `weights` where given); logits are computed only where
    a target exists.

    `weights` (B, T) lets the few tokens that decide a task — the values copied from the context — count more
    than the call syntax around them, which the base learns early and then only repeats.

    With `context_weight` > 0 the forced tokens (instruction, observations, experiences) are predicted too, at
    that weight: an auxiliary language-modelling signal that, like pretraining, teaches a tiny model to attend
    to and copy from its context far sooner than the action tokens alone do. With `context_fraction` < 1 that
    mean is estimated on a random share of the context positions (torch's seeded generator): the output head
    and its softmax over the whole vocabulary then run on far fewer rows, which is most of what the auxiliary
    loss costs, for a noisier estimate of the same term.
    """
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state  # (B, T, D)
    targets = labels[:, 1:]
    where = targets != -100  # (B, T-1): position t predicts token t+1
    logits = model.lm_head(hidden[:, :-1][where])  # (N, V), only supervised positions
    if weights is None:
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[where])
    else:
        w = weights[:, 1:][where]  # (N,)
        per_token = torch.nn.functional.cross_entropy(logits.float(), targets[where], reduction="none")
        loss = (w * per_token).sum() / w.sum()
    if context_weight > 0:
        context = (attention[:, 1:] == 1) & ~where
        if context_fraction < 1.0:
            context &= torch.rand(context.shape, device=context.device) < context_fraction
        if context.any():
            context_logits = model.lm_head(hidden[:, :-1][context])
            loss = loss + context_weight * torch.nn.functional.cross_entropy(
                context_logits.float(), ids[:, 1:][context]
            )
    return loss


def is_hidden_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """A transformer layer's weight matrix (attention and MLP projections): what Muon orthogonalises. The
    (tied) embedding and the norms' gains are not matrices of that kind and stay with AdamW."""
    return param.ndim == 2 and ".layers." in name


def make_optimizers(model: torch.nn.Module, ws) -> list[torch.optim.Optimizer]:
    """The warm start's optimizers; every param group keeps its peak rate in `initial_lr` for the schedule.

    Why Muon: the build is bound by optimizer steps, not tokens (2,048-token batches at half the steps, or
    512-token batches at twice, both did worse), so what counts is the progress each update makes. Muon's
    orthogonalised momentum updates every direction of a layer's matrix at the same rate, so each step of the
    embedded base's build teaches more than AdamW's (`probes/warmstart_optimizer.py` compares them).
    """

    def with_peak(opt: torch.optim.Optimizer, lr: float) -> torch.optim.Optimizer:
        for group in opt.param_groups:
            group["initial_lr"] = lr
        return opt

    def adamw(params_) -> torch.optim.Optimizer:
        return with_peak(torch.optim.AdamW(params_, lr=ws.lr, weight_decay=0.01, betas=(0.9, 0.98)), ws.lr)

    if ws.optimizer == "adamw":
        return [adamw(model.parameters())]
    named = list(model.named_parameters())
    matrices = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return [adamw(rest), with_peak(StackedMuon(matrices, lr=ws.muon_lr, weight_decay=0.01), ws.muon_lr)]


def train_step(
    model,
    optimizers: list[torch.optim.Optimizer],
    batch: list[TrajectoryIds],
    pad_id: int,
    ws,
    factor: float,
    is_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """One warm-start update on `batch` at `factor` times each group's peak rate; returns the loss."""
    ids, attention, labels, weights = collate(batch, pad_id, is_value, ws.copy_weight)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
    loss = action_token_loss(
        model,
        ids,
        attention,
        labels,
        ws.context_loss_weight,
        ws.context_loss_fraction,
        None if ws.copy_weight == 1.0 else weights,
    )
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for optimizer in optimizers:
        optimizer.step()
    return loss.detach()


def lr_factor(step: int, planned: int, warmup_steps: int) -> float:
    """The schedule's factor on each group's peak rate: linear warm-up, cosine down to 5 %."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, planned - warmup_steps)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def replan(step: int, elapsed: float, since_mark: float, planned_at_most: int, time_budget_s: float) -> int:
    """The steps the time budget still affords, re-estimated from the last 10 steps' pace (the machine may be
    busy): a cosine cut off half-way would end at a high learning rate."""
    pace = since_mark / 10
    affordable = step + int(max(0.0, time_budget_s - elapsed) / max(pace, 1e-6))
    return max(step + 1, min(planned_at_most, affordable))


@dataclass(frozen=True)
class WarmStartRun:
    steps: int
    epochs_done: float
    final_loss: float  # an exponential mean of the last steps' losses
    seconds: float


def train_warm_start(
    model, seqs: list[TrajectoryIds], pad_id: int, tokenizer, ws, rng: random.Random, log=print
) -> WarmStartRun:
    """The warm start of `model` on `seqs` under the `model.warmstart` settings `ws` (module docstring)."""
    batches = pack_batches(seqs, ws.batch_tokens, rng)
    total_steps = ws.max_steps or max(1, int(len(batches) * ws.epochs))
    optimizers = make_optimizers(model, ws)
    is_value = value_tokens(tokenizer) if ws.copy_weight != 1.0 else None
    model.train()
    started = time.perf_counter()
    step, loss_ema, planned, last_mark = 0, float("nan"), total_steps, 0.0
    while step < planned:
        if step and step % len(batches) == 0:
            rng.shuffle(batches)
        batch = [seqs[i] for i in batches[step % len(batches)]]
        factor = lr_factor(step, planned, ws.warmup_steps)
        loss = train_step(model, optimizers, batch, pad_id, ws, factor, is_value)
        loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
        step += 1
        elapsed = time.perf_counter() - started
        if step % 10 == 0 and not ws.max_steps:
            planned = replan(step, elapsed, elapsed - last_mark, total_steps, ws.time_budget_s)
            last_mark = elapsed
        if step % 25 == 0 or step == planned:
            lr = ws.lr * lr_factor(step, planned, ws.warmup_steps)
            log(f"base: step {step}/{planned} loss {loss_ema:.3f} lr {lr:.2e} ({elapsed:.0f}s)")
        if elapsed > ws.time_budget_s * 1.1 and not ws.max_steps:
            log(f"base: time budget {ws.time_budget_s:.0f}s overrun at step {step}/{planned}; stopping")
            break
    return WarmStartRun(step, round(step / len(batches), 3), round(loss_ema, 4), time.perf_counter() - started)

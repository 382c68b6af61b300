"""`lopd base`: build the embedded base policy — tokenizer, tiny Qwen3, supervised warm start — and save it as a
standard Hugging Face directory.

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

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from lopd_core.config import Params
from lopd_core.envs.mix import mix_counts, pretraining_mix
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.model.chat import ChatCodec, TrajectoryIds
from lopd_core.model.codegen_demos import build_codegen_demos
from lopd_core.model.demos import build_demos, encode_demo
from lopd_core.model.drills import build_drills, encode_drill
from lopd_core.model.loading import pin_threads, tiny_qwen3
from lopd_core.model.muon import StackedMuon
from lopd_core.model.tokenizer import train_tokenizer
from lopd_core.outputs import check_folder, publish_folder

# Left in every built base: a later `lopd base` may replace a folder holding it, and no other non-empty folder.
BASE_MARKER = ".lopd-base"
# What a base folder holds (the last two: the cycle's stage summary and cache key).
BASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "build_report.json",
    "_stage.json",
    "_key.json",
}


def _earlier_base(folder: Path, names: set[str]) -> bool:
    """A base built before the marker existed: nothing but a base's files, among them a build report that names
    the warm start (a plain Hugging Face folder of the user's has the same file names, never this report)."""
    if not names <= BASE_FILES or "build_report.json" not in names:
        return False
    try:
        return "demos" in json.loads((folder / "build_report.json").read_text())
    except (OSError, ValueError):
        return False


@dataclass
class BaseBuildReport:
    demos: int
    drills: int  # drills and first-action cuts mixed in (drills.py)
    demo_tokens: int
    action_tokens: int
    parameters: int
    steps: int
    epochs_done: float
    final_loss: float
    seconds_demos: float
    seconds_train: float
    seconds_total: float
    out_dir: str


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


def build_base(params: Params, out_dir: str | Path, log=print) -> BaseBuildReport:
    """Build the embedded base into `out_dir`, swapped in whole once saved (lopd_core/outputs.py): a missing or
    empty folder or an earlier base is replaced; any other folder is refused before the minutes of training."""
    check_folder(out_dir, BASE_MARKER, "a base", _earlier_base)
    t0 = time.perf_counter()
    ws, tiny = params.model.warmstart, params.model.tiny
    pin_threads(params.model)  # the same base whatever the machine's cores (model.threads)
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    # Demonstrations per env in the proportions of the mix's pretraining part: a plugin environment has no oracle
    # or pretraining worlds, so its share goes to the built-ins rather than being dropped.
    counts = mix_counts(pretraining_mix(params.envs.mix), ws.demos)
    demos = build_demos(
        n=counts.get("toolworld", 0),
        experience_fraction=ws.experience_fraction,
        max_experiences=ws.max_experiences,
        convention_noise=ws.convention_noise,
        slip=ws.slip,
        seed=params.seed,
        worlds=WorldSplit.from_config(params.envs).pretrain,
    )
    if counts.get("codegen"):  # appended: the toolworld part (and its first-action cuts) stay as they were
        demos += build_codegen_demos(
            n=counts["codegen"],
            experience_fraction=ws.experience_fraction,
            max_experiences=ws.max_experiences,
            noise=ws.convention_noise,
            slip=ws.slip,
            seed=params.seed + 1,
        )
    tokenizer = train_tokenizer((d.text() for d in demos), tiny.vocab_size)
    codec = ChatCodec(tokenizer)
    seqs = [encode_demo(d, codec) for d in demos]
    seqs = [s for s in seqs if len(s) <= tiny.max_positions]
    # Drills and first-action cuts are mixed in: pack_batches groups them by length, so their short batches
    # interleave with the demonstrations' all through training (run first as a block, they were forgotten).
    drills = [encode_drill(d, codec) for d in build_drills((d.text() for d in demos), ws.drills, params.seed)]
    drills += [first_action(s) for s in seqs[: ws.drills]]
    t_demos = time.perf_counter() - t0
    demo_tokens = sum(len(s) for s in seqs)
    action_tokens = sum(sum(s.action_mask) for s in seqs)
    log(
        f"base: {len(seqs)} demonstrations, {demo_tokens} tokens ({action_tokens} supervised), "
        f"vocab {len(tokenizer)}, built in {t_demos:.1f}s"
    )

    model = tiny_qwen3(tiny, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    n_demos = len(seqs)
    seqs = seqs + drills
    batches = pack_batches(seqs, ws.batch_tokens, rng)
    total_steps = ws.max_steps or max(1, int(len(batches) * ws.epochs))
    optimizers = make_optimizers(model, ws)
    is_value = value_tokens(tokenizer) if ws.copy_weight != 1.0 else None

    def lr_at(step: int, planned: int) -> float:
        """The schedule's factor on each group's peak rate: linear warm-up, cosine down to 5 %."""
        if step < ws.warmup_steps:
            return (step + 1) / ws.warmup_steps
        progress = (step - ws.warmup_steps) / max(1, planned - ws.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    model.train()
    t_train = time.perf_counter()
    step, loss_ema, planned, last_mark = 0, float("nan"), total_steps, 0.0
    while step < planned:
        if step and step % len(batches) == 0:
            rng.shuffle(batches)
        batch = [seqs[i] for i in batches[step % len(batches)]]
        loss = train_step(model, optimizers, batch, codec.pad_id, ws, lr_at(step, planned), is_value)
        loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
        step += 1
        elapsed = time.perf_counter() - t_train
        if step % 10 == 0 and not ws.max_steps:
            # Fit the schedule to the time budget, re-estimated from the last 10 steps (the machine may be
            # busy): a cosine cut off half-way would end at a high learning rate.
            recent = (elapsed - last_mark) / 10
            last_mark = elapsed
            affordable = step + int(max(0.0, ws.time_budget_s - elapsed) / max(recent, 1e-6))
            planned = max(step + 1, min(total_steps, affordable))
        if step % 25 == 0 or step == planned:
            lr = ws.lr * lr_at(step, planned)
            log(f"base: step {step}/{planned} loss {loss_ema:.3f} lr {lr:.2e} ({elapsed:.0f}s)")
        if elapsed > ws.time_budget_s * 1.1 and not ws.max_steps:
            log(f"base: time budget {ws.time_budget_s:.0f}s overrun at step {step}/{planned}; stopping")
            break
    seconds_train = time.perf_counter() - t_train

    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=codec.im_end_id, pad_token_id=codec.pad_id, do_sample=False, max_new_tokens=64
    )
    report = BaseBuildReport(
        demos=n_demos,
        drills=len(drills),
        demo_tokens=demo_tokens,
        action_tokens=action_tokens,
        parameters=n_params,
        steps=step,
        epochs_done=round(step / len(batches), 3),
        final_loss=round(loss_ema, 4),
        seconds_demos=round(t_demos, 1),
        seconds_train=round(seconds_train, 1),
        seconds_total=round(time.perf_counter() - t0, 1),
        out_dir=str(out_dir),
    )

    def fill(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "build_report.json").write_text(json.dumps(asdict(report), indent=2))

    publish_folder(out_dir, BASE_MARKER, "a base", fill, _earlier_base)
    return report

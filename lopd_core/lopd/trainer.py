"""`lopd distill`: the LOPD training loop (DESIGN §3), one step at a time, resumable.

Per step, in this order:
  1. roll out B tasks × G samples with the current student (token in, token out);
  2. retrieve J experiences per task, compose latents c_φ, score the student's tokens with the latent teacher
     and keep its top-k log-probs and ids;
  3. student update: reverse KL(p_S ‖ p_T) on the teacher's top-k + tail (or full / sampled), token mean;
  4. composer update through the frozen teacher: KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor;
  5. dual ascent: β ← max(0, β + η_β·(m − δ̄)).
Steps 2 and 4 share one teacher forward: it is run with the composer's graph attached, step 2 takes a
detached copy of what it needs and step 4 back-propagates through the same activations afterwards (the
composer has not changed in between, so this is exactly the specified order, one teacher pass cheaper).
Steps 2-4 run in micro-batches of `lopd.micro_batch` trajectories with gradients accumulated (see `update`):
peak memory is one chunk's teacher and student graphs rather than the whole batch's, and the optimizer steps
are still taken once, in the order above, on exactly the whole-batch gradients.

Everything a step needs is derived from (seed, step): its tasks are a fixed slice of the training stream and
its sampling generator is seeded by the step, so a run resumed from a checkpoint prints the same numbers as an
uninterrupted one. A non-finite loss or gradient norm skips that update (counted, never applied).
"""

from __future__ import annotations

import copy
import csv
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lopd_core import distributed as D
from lopd_core.config import Params
from lopd_core.envs import Task
from lopd_core.envs.mix import mixed_tasks
from lopd_core.lopd import losses as L
from lopd_core.lopd import methods as M
from lopd_core.lopd.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.lopd.models import export_student, make_student_and_teacher
from lopd_core.lopd.prefix import score_actions_shared
from lopd_core.lopd.teacher import Framing, action_logits, build_batch
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

CSV_COLUMNS = [
    "step", "rollouts", "reward_mean", "success_rate", "distill_loss", "kl_phi", "delta", "beta", "anchor",
    "student_entropy", "teacher_entropy", "topk_mass", "grad_norm_theta", "grad_norm_phi", "latent_norm_ratio",
    "step_seconds",
]
DIAGNOSTIC_COLUMNS = [
    "step", "margin_success", "margin_failure", "latent_norm", "embedding_norm", "skipped_updates",
    "encoder_cache_hits", "rollout_s", "teacher_s", "student_s", "composer_s",
]

Retriever = Callable[[list[Task]], list[list[str]]]  # tasks -> experience texts per task


@dataclass
class DistillState:
    step: int = 0  # steps completed
    beta: float = 0.0
    rollouts: int = 0  # trajectories sampled so far (including the bank's seed rollouts)
    skipped_updates: int = 0
    history: list[dict] = field(default_factory=list)


def load_composer(path: str | Path, lm_width: int, cfg, embedding_norm: float) -> Composer:
    composer = Composer(lm_width, num_queries=cfg.num_queries, hidden_size=cfg.hidden_size,
                        num_layers=cfg.num_layers, num_heads=cfg.num_heads, embedding_norm=embedding_norm)
    if path and Path(path).exists():
        composer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return composer


def _tail_logmass(logprobs: torch.Tensor, support_ids: torch.Tensor) -> torch.Tensor:
    """Log of the mass outside `support_ids`, (N, V) normalised log-probs -> (N,).

    The tail half of L.topk_support_logprobs minus its log-softmax, because the trainer already holds the
    log-softmax of both models' logits and reuses it (one (N, V) pass per model instead of three). Same guards:
    a finite fill rather than −inf for the support, the clamp at log(TAIL_FLOOR).
    """
    outside = logprobs.scatter(-1, support_ids, torch.finfo(logprobs.dtype).min)  # (N, V)
    return torch.logsumexp(outside, dim=-1).clamp(min=math.log(L.TAIL_FLOOR))


def micro_batches(lengths: list[int], size: int, group: int = 1) -> list[list[int]]:
    """Indices of the rows in each micro-batch of at most `size` rows (0 = one batch, in the original order).

    Rows are grouped by length so that a chunk pads to little more than its own rows; every loss is a sum over
    rows divided by a whole-batch count, so the grouping changes no value. With `group` > 1, each run of
    `group` consecutive rows (a task's samples) stays in one chunk, ordered by its longest row — so a teacher
    that runs a shared prompt once per task (`lopd.share_prompt`) finds all its samples together. Shared with
    benchmarks/step_cost.py, whose policy-gradient baseline must chunk exactly as the trainer does.
    """
    if size <= 0 or size >= len(lengths):
        return [list(range(len(lengths)))] if lengths else []
    group = max(1, min(group, size))
    units = [list(range(s, min(s + group, len(lengths)))) for s in range(0, len(lengths), group)]
    units.sort(key=lambda u: max(lengths[i] for i in u))
    chunks: list[list[int]] = []
    for unit in units:
        if chunks and len(chunks[-1]) + len(unit) <= size:
            chunks[-1].extend(unit)
        else:
            chunks.append(list(unit))
    return chunks


def chunk_group(samples_per_task: int, share_prompt: bool) -> int:
    """Rows a micro-batch keeps together: a task's samples when the teacher shares their prompt, so it runs
    once per chunk; otherwise rows go wherever their length puts them."""
    return samples_per_task if share_prompt else 1


def sample_seed(seed: int, step: int, task_index: int, sample_index: int) -> int:
    """The sampling seed of one trajectory: a function of where it sits in the run, not of which process or
    batch plays it (a fixed mixing of the four integers into 63 bits)."""
    x = seed
    for v in (step, task_index, sample_index):
        x = (x * 1_000_003 + v + 0x9E3779B97F4A7C15) % (1 << 63)
    return x


def _grad_norm(params, max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm))


class Distiller:
    """Holds the models, optimizers and state of one distillation run."""

    def __init__(self, params: Params, base, tokenizer, retriever: Retriever, *, composer: Composer,
                 initial_rollouts: int = 0, log=print):
        D.setup()  # joins the process group under `accelerate launch`; a no-op in one process
        if D.world_size() > params.lopd.tasks_per_step:
            raise ValueError(f"lopd.tasks_per_step: got {params.lopd.tasks_per_step}, expected at least the "
                             f"number of processes ({D.world_size()}): every rank needs a task per step")
        torch.manual_seed(params.seed)
        self.params, self.cfg = params, params.lopd
        self.log = log if D.is_main() else (lambda *_a, **_k: None)  # one voice, not one per rank
        # The method (LOPD, a baseline or an ablation: lopd_core/lopd/methods.py) picks the teacher's context and
        # weights and the student's loss; the rest of the loop is shared by all of them.
        self.method = M.method_spec(self.cfg.method, params.baselines)
        self.margin = self.cfg.margin if self.method.margin is None else self.method.margin
        self.anchor_weight = (self.cfg.anchor_weight if self.method.anchor_weight is None
                              else self.method.anchor_weight)
        self.teacher_pass = self.method.needs_teacher_pass or params.baselines.grpo_kl > 0
        self.codec = ChatCodec(tokenizer)
        self.tokenizer = tokenizer
        self.framing = Framing.from_tokenizer(tokenizer)
        self.trainable, self.student, self.teacher = make_student_and_teacher(
            base, mode=self.cfg.student_mode, lora_rank=self.cfg.lora_rank)
        self.encoder = ExperienceEncoder(self.teacher, tokenizer, max_tokens=params.composer.max_experience_tokens)
        self.composer = composer.train().requires_grad_(self.method.composer_trainable)
        self.ema_lm = M.ema_copy(self.student) if self.method.teacher_weights == "ema" else None
        self.anchor_composer = copy.deepcopy(composer).eval().requires_grad_(False)  # φ0, fixed
        self._anchor_cache: dict[str, torch.Tensor] = {}  # experience text -> φ0's (K, D) latents
        self.embedding_norm = mean_embedding_norm(self.student)
        self.retriever = retriever
        self.opt_theta = torch.optim.AdamW([p for p in self.trainable.parameters() if p.requires_grad],
                                           lr=self.cfg.lr_student, weight_decay=0.0)
        self.opt_phi = torch.optim.AdamW(self.composer.parameters(), lr=self.cfg.lr_composer, weight_decay=0.0)
        self.state = DistillState(beta=self.cfg.beta_init, rollouts=initial_rollouts)
        # Trade compute for peak memory (see `update`): s_old from an extra no-grad student forward per chunk, so a
        # chunk's teacher and student graphs never coexist, and the resampler run twice instead of holding its
        # graph through the chunks. Same gradients either way.
        self.low_memory = self.cfg.teacher_micro_batch > 0  # (benchmarks/tests may also set it: whole-chunk passes)
        self.task_stream = mixed_tasks(params.envs.mix, "train", self.cfg.steps * self.cfg.tasks_per_step,
                                       params.seed + 17)  # envs interleaved: every step draws the mix

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One full step: roll out this step's tasks, then `update` on the trajectories."""
        cfg, ro = self.cfg, self.params.rollout
        started = time.perf_counter()
        s = self.state.step
        first = s * cfg.tasks_per_step
        # Under `accelerate launch` each rank takes its contiguous slice of the step's tasks (all G samples of
        # a task on one rank, so group advantages stay local); `update` reduces across ranks.
        mine = D.shard_range(cfg.tasks_per_step)
        tasks = self.task_stream[first + mine.start:first + mine.stop]

        # 1. Rollouts with the current student. Each trajectory's sampling stream is seeded by (seed, step,
        # task index in the stream, sample), so any number of ranks samples what one process samples.
        requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(cfg.samples_per_task)]
        seeds = [sample_seed(self.params.seed, s, first + mine.start + i // cfg.samples_per_task,
                             i % cfg.samples_per_task) for i in range(len(requests))]
        sampling = Sampling(temperature=cfg.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                            max_context=ro.max_context)
        trajs = rollout(self.student, self.codec, requests, sampling=sampling, batch_size=ro.batch_size,
                        seed=self.params.seed * 1_000_003 + s, seeds=seeds)
        self.state.rollouts += cfg.tasks_per_step * cfg.samples_per_task  # every rank's, not only this one's
        return self.update(tasks, trajs, started=started)

    def update(self, tasks: list[Task], trajs: list, *, started: float | None = None) -> dict:
        """Steps 2-5 on trajectories of `tasks` (samples_per_task each, in task order). Also what
        benchmarks/step_cost.py times against a plain policy-gradient update.

        The batch is processed in chunks of `lopd.micro_batch` trajectories (0 = one chunk): per chunk, the
        teacher forward (graph to the latents), the student forward and backward, then the composer's chunk
        loss backward through the teacher, after which both graphs are gone. Gradients accumulate; the student
        optimizer steps only after every chunk, then the composer (after its own backward through the
        resampler), then β — the order of DESIGN §3. Every loss is a token-weighted (or trajectory-weighted)
        mean and the dual term is linear in δ̄, so each chunk's sum is divided by the *whole batch's* token
        count, computed up front: the accumulated gradients, δ̄, the KL and the entropies equal the whole-batch
        ones (up to float summation order). The composer's s_old is the student's detached logits of the same
        chunk, taken before any optimizer step, so it is the pre-update student, as specified.

        Peak memory is then one chunk's teacher and student graphs together (the teacher's is kept from its
        forward until the composer's chunk loss, which needs s_old) plus the resampler's graph. `low_memory`
        takes s_old from a no-grad student forward first, so the teacher's graph is consumed before the
        student's is built, and runs the resampler again at the end rather than keeping its graph: peak is the
        larger of the two graphs, for one more student forward per chunk and one more resampler forward.
        """
        cfg = self.cfg
        started = time.perf_counter() if started is None else started
        t_rollout = time.perf_counter()
        n_traj = len(trajs)
        ids = [t.token_ids for t in trajs]
        masks = [t.action_mask for t in trajs]
        rewards = torch.tensor([t.reward for t in trajs])
        successes = torch.tensor([t.success for t in trajs])
        groups = torch.tensor([i // cfg.samples_per_task for i in range(n_traj)])
        device = self.composer.queries.device
        adv = L.advantages(rewards, kind=cfg.advantage, successes=successes, group_ids=groups).to(device)
        centred = cfg.margin_gap == "centred"  # δ on the centred gap (losses.centred_gap)
        spec, bl = self.method, self.params.baselines
        pg_adv = (L.group_relative_advantages(rewards, groups, eps=bl.group_std_eps).to(device)
                  if spec.loss != "reverse_kl" else None)  # GRPO: (r − group mean) / (group std + eps)
        # Whole-batch normalisers, known before any chunk runs (position 0 never predicts: see build_batch).
        counts = torch.tensor([sum(1 for m in mask[1:] if m) for mask in masks], dtype=torch.long)  # (B,)
        # Under data parallelism B is this rank's shard and n_tokens every rank's: each rank's sums are its
        # share of the global token mean, and summing gradients over ranks gives the whole-batch gradient.
        n_tokens = max(int(D.global_sum([int(counts.sum())])[0]), 1)
        counts_dev = counts.to(device)
        beta_used = self.state.beta
        acc = dict.fromkeys(("distill", "kl", "delta", "s_ent", "t_ent", "topk_mass"), 0.0)
        gap_sum = torch.zeros(n_traj, device=device)  # per trajectory Σ (log p_T,φ − log p_S,old), action tokens
        kl_sum = torch.zeros(n_traj, device=device)  # per trajectory Σ KL(p_S,old ‖ p_T,φ): gap + KL = centred gap
        phase = dict.fromkeys(("teacher", "student", "composer"), 0.0)

        # 2a. Latents once per distinct experience text: the G samples of a task (and tasks sharing a bank row)
        # read the same texts, and the resampler treats each experience independently, so composing the
        # duplicates again would only repeat work. The chunks' teacher backward stops at a detached leaf
        # (`lat_leaf`); its accumulated gradient is pushed through the resampler once, after the last chunk.
        per_task = self.retriever(tasks) if spec.uses_bank else [[] for _ in tasks]
        # Baselines whose teacher reads text (or nothing) instead of latents: the composer reads nothing.
        text_context = M.text_contexts(spec, tasks, trajs, per_task, cfg.samples_per_task)  # (B,) or None
        experiences = [per_task[i // cfg.samples_per_task] if spec.needs_composer else [] for i in range(n_traj)]
        # A trajectory without a context (SDPO's groups without a success) gives no signal: its tokens leave
        # the student loss and its normaliser.
        signal_w = None
        n_signal = n_tokens
        if spec.teacher_context == "sibling":  # (decided by the method, so every rank takes the same branch)
            signal_w = torch.tensor([c is not None for c in text_context], dtype=torch.float32, device=device)
            n_signal = max(int(D.global_sum([int((counts * (signal_w.cpu() > 0)).sum())])[0]), 1)
        texts = list(dict.fromkeys(t for ex in experiences for t in ex))
        slot = {t: i for i, t in enumerate(texts)}
        slots = [[slot[t] for t in ex] for ex in experiences]
        width = self.composer.proj_out.out_features
        lat_u = lat_leaf = None
        if texts:
            states, state_mask = self.encoder.encode(texts)
            states, state_mask = states.to(device), state_mask.to(device)
            if self.low_memory or not spec.composer_trainable:  # graph rebuilt at the end (or never: φ = φ0)
                with torch.no_grad():
                    lat_leaf = self.composer(states, state_mask)
            else:
                lat_u = self.composer(states, state_mask)  # (U, K, D), graph to φ
                lat_leaf = lat_u.detach()
            lat_leaf.requires_grad_(spec.composer_trainable)
        phase["teacher"] += time.perf_counter() - t_rollout

        def traj_latents(i: int) -> torch.Tensor:
            if not slots[i]:
                return torch.zeros((0, width), device=device)
            return lat_leaf[slots[i]].reshape(-1, width)  # (J·K, D)

        def student_step(chunk, sbatch, top_lp, top_ids, t_logits, t_action_lp, keep_old: bool = True):
            """Step 3 on a chunk: forward, loss (its share of the batch's token mean), backward. Returns the
            pre-update student's detached log-probs (N, V) for the composer's loss (None unless `keep_old`: the
            low-memory order took them earlier, and an (N, V) tensor less is alive through the backward)."""
            s_logits = action_logits(self.student, sbatch)  # (n, V)
            s_lp_old = (torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V) sg[log p_S,old], reused below
                        if keep_old or cfg.importance_weight else None)
            rows = torch.tensor(chunk, dtype=torch.long, device=device)[sbatch.token_traj_index]  # (n,) trajectory
            if spec.loss != "reverse_kl":  # GRPO (one step per batch: π_old = the pre-update student)
                s_action_lp = torch.log_softmax(s_logits, -1).gather(-1, sbatch.action_ids[:, None]).squeeze(-1)
                per_token = L.clipped_policy_loss(s_action_lp, s_action_lp.detach(), pg_adv[rows], clip=bl.grpo_clip)
                if spec.loss == "grpo" and t_action_lp is not None:  # KL to the frozen base (baselines.grpo_kl)
                    per_token = per_token + bl.grpo_kl * L.reference_kl_k3(s_action_lp, t_action_lp.detach())
                if spec.loss == "grpo+kl":  # Skill-SD: plus a small sampled-token reverse KL to its teacher
                    per_token = per_token + bl.skill_kl * L.reverse_kl_sampled(s_action_lp, t_action_lp.detach())
            elif cfg.student_loss == "topk":
                per_token = L.reverse_kl_topk(s_logits, top_lp, top_ids)
            elif cfg.student_loss == "full":
                per_token = L.reverse_kl_full(s_logits, t_logits.detach())
            else:
                s_action_lp = torch.log_softmax(s_logits, -1).gather(-1, sbatch.action_ids[:, None]).squeeze(-1)
                per_token = L.reverse_kl_sampled(s_action_lp, t_action_lp.detach())
            if cfg.token_focus < 1.0 and spec.loss == "reverse_kl":  # (per chunk: its own largest disagreements)
                per_token = per_token * L.focus_weights(per_token, cfg.token_focus)
            if cfg.importance_weight:
                s_action_old = s_lp_old.gather(-1, sbatch.action_ids[:, None]).squeeze(-1)
                sample_lp = torch.tensor([lp for i in chunk for lp, m in zip(trajs[i].sample_logprobs[1:],
                                                                            trajs[i].action_mask[1:]) if m],
                                         device=device)
                per_token = per_token * L.truncated_importance_weight(s_action_old, sample_lp,
                                                                      cap=cfg.importance_cap)
            if signal_w is not None:
                per_token = per_token * signal_w[rows]
            distill_part = per_token.sum() / n_signal  # this chunk's share of the batch's token mean
            distill_part.backward()
            acc["distill"] += float(distill_part.detach())
            return s_lp_old if keep_old else None

        def composer_step(chunk_t, tbatch, t_lp, t_action_lp, top_ids, s_lp_old, action_ids) -> None:
            """Step 4 on a chunk: KL(sg[p_S,old] ‖ p_T,φ) and −β·δ̄ (shares of the batch's means), backward
            through the frozen teacher to the latent leaf; the teacher's graph is gone afterwards."""
            s_action_old = s_lp_old.gather(-1, action_ids[:, None]).squeeze(-1)  # (n,)
            p_lp, p_tail = s_lp_old.gather(-1, top_ids), _tail_logmass(s_lp_old, top_ids)
            q_lp, q_tail = t_lp.gather(-1, top_ids), _tail_logmass(t_lp, top_ids)
            kl_tokens = L.support_kl(p_lp, p_tail, q_lp, q_tail)  # (n,)
            kl_part = kl_tokens.sum() / n_tokens
            delta = L.privileged_margin_delta(t_action_lp, s_action_old, adv[chunk_t], tbatch.token_traj_index,
                                              len(chunk_t), centre=kl_tokens if centred else None)  # (c,) δ(τ)
            delta_part = (delta * counts_dev[chunk_t]).sum() / n_tokens  # its share of δ̄ = Σ n_τ δ(τ) / Σ n_τ
            phi_part = kl_part - beta_used * delta_part  # the β·m constant has no gradient
            if phi_part.requires_grad:  # (only chunks picked for the composer keep a graph: rescaled to the batch)
                (phi_part * composer_scale).backward()
            acc["kl"] += float(kl_part.detach())
            acc["delta"] += float(delta_part.detach())
            acc["s_ent"] += float(-(s_lp_old.exp() * s_lp_old).sum())
            token_rows = chunk_t[tbatch.token_traj_index]  # each action token's trajectory in the batch
            gap_sum.index_add_(0, token_rows, t_action_lp.detach() - s_action_old)
            kl_sum.index_add_(0, token_rows, kl_tokens.detach())

        def teacher_pass(rows: list[int], graph: bool):
            """Step 2 on `rows` (consecutive rows of a chunk): teacher scoring with the latents spliced in; one
            log-softmax serves top-k, entropy, the composer's KL and δ (the graph is kept when `graph`, for step
            4). The baselines' teachers read text or nothing in the same slot, with their own weights, and need
            no graph. Returns (batch, logits, log-probs, top-k log-probs, top-k ids, action log-probs)."""
            r_ids, r_masks = [ids[i] for i in rows], [masks[i] for i in rows]
            with self._teacher_lm() as teacher_lm, nullcontext() if graph else torch.no_grad():
                if spec.needs_composer:
                    context = [traj_latents(i) for i in rows]
                    keys = [tuple(slots[i]) for i in rows]  # equal slots: the same latent rows
                elif text_context is not None:
                    context = self._context_embeddings(teacher_lm, [text_context[i] for i in rows])
                    keys = [text_context[i] for i in rows]
                else:
                    context = keys = None
                if cfg.share_prompt:  # each task's prompt and latents once for its samples (prefix.py)
                    tbatch = score_actions_shared(teacher_lm, r_ids, r_masks, context, self.framing, keys)
                    t_logits = tbatch.logits  # (n, V)
                else:
                    tbatch = build_batch(teacher_lm, r_ids, r_masks, context, self.framing)
                    t_logits = action_logits(teacher_lm, tbatch)  # (n, V)
            if spec.teacher_temperature != 1.0:  # the sharpened-teacher control
                t_logits = t_logits / spec.teacher_temperature
            t_lp = torch.log_softmax(t_logits, dim=-1)  # (n, V), differentiable w.r.t. the latents
            t_lp_d = t_lp.detach()
            top_lp, top_ids = t_lp_d.topk(min(cfg.top_k, t_lp_d.shape[-1]), dim=-1)  # (n, k)
            t_action_lp = t_lp.gather(-1, tbatch.action_ids[:, None]).squeeze(-1)  # (n,)
            acc["t_ent"] += float(-(t_lp_d.exp() * t_lp_d).sum())
            acc["topk_mass"] += float(top_lp.exp().sum())
            return tbatch, t_logits, t_lp, top_lp, top_ids, t_action_lp

        def run_chunk(chunk: list[int], keep_graph: bool = True) -> None:
            """Steps 2-4 on one chunk, gradients accumulated. A function so that every tensor of the chunk
            (logits, log-probs, padded inputs) is released when it returns, before the next chunk starts."""
            t0 = time.perf_counter()
            c_ids, c_masks = [ids[i] for i in chunk], [masks[i] for i in chunk]
            chunk_t = torch.tensor(chunk, dtype=torch.long, device=device)
            sbatch = build_batch(self.student, c_ids, c_masks)
            s_lp_old = None
            if self.low_memory:  # s_old first, so the teacher's graph can go before the student's is built
                with torch.no_grad():
                    s_lp_old = torch.log_softmax(action_logits(self.student, sbatch), dim=-1)
            t1 = time.perf_counter()
            if not self.teacher_pass:  # GRPO without a reference KL: the student alone
                s_lp_old = student_step(chunk, sbatch, None, None, None, None)
                acc["s_ent"] += float(-(s_lp_old.exp() * s_lp_old).sum())
                phase["student"] += time.perf_counter() - t0
                return
            graph = spec.needs_composer and spec.composer_trainable and keep_graph
            if not self.low_memory:
                tbatch, t_logits, t_lp, top_lp, top_ids, t_action_lp = teacher_pass(chunk, graph)
                t2 = time.perf_counter()
                s_lp_old = student_step(chunk, sbatch, top_lp, top_ids, t_logits, t_action_lp)
                t3 = time.perf_counter()
                composer_step(chunk_t, tbatch, t_lp, t_action_lp, top_ids, s_lp_old, sbatch.action_ids)
                phase["teacher"] += t2 - t1
                phase["student"] += t3 - t2 + t1 - t0
                phase["composer"] += time.perf_counter() - t3
                return
            # Low memory: teacher passes of `lopd.teacher_micro_batch` consecutive rows (0: the whole chunk), each
            # consumed by the composer's backward before the next; the student then steps on their targets.
            # The chunk's action tokens are ordered row by row, so a pass's tokens are a contiguous slice.
            size = cfg.teacher_micro_batch or len(chunk)
            keep_logits = cfg.student_loss == "full"  # the only student loss that reads the full teacher logits
            targets, offset = [], 0
            for k in range(0, len(chunk), size):
                part = chunk[k:k + size]
                ta = time.perf_counter()
                tbatch, t_logits, t_lp, top_lp, top_ids, t_action_lp = teacher_pass(part, graph)
                tb = time.perf_counter()
                n = tbatch.action_ids.shape[0]
                composer_step(chunk_t[k:k + size], tbatch, t_lp, t_action_lp, top_ids, s_lp_old[offset:offset + n],
                              sbatch.action_ids[offset:offset + n])
                offset += n
                targets.append((top_lp, top_ids, t_logits.detach() if keep_logits else None, t_action_lp.detach()))
                phase["teacher"] += tb - ta
                phase["composer"] += time.perf_counter() - tb
            if offset != sbatch.action_ids.shape[0]:
                raise RuntimeError("teacher passes and the student chunk disagree on the action tokens")
            t3 = time.perf_counter()
            top_lp, top_ids, t_logits, t_action_lp = (
                None if parts[0] is None else torch.cat(parts) for parts in zip(*targets))
            del targets, s_lp_old  # the composer is done with them: not alive through the student's backward
            student_step(chunk, sbatch, top_lp, top_ids, t_logits, t_action_lp, keep_old=False)
            phase["student"] += time.perf_counter() - t3 + t1 - t0

        self.opt_theta.zero_grad(set_to_none=True)
        chunks = self._chunks(ids)
        picked = self._composer_chunks(len(chunks))
        # The composer's gradient from the picked chunks, rescaled to the whole batch's token count (summed over
        # ranks): unbiased for the full gradient; exactly 1 when every chunk is picked.
        picked_tokens = D.global_sum([int(sum(counts[i] for c in picked for i in chunks[c]))])[0]
        composer_scale = n_tokens / max(picked_tokens, 1)
        for c, chunk in enumerate(chunks):
            run_chunk(chunk, keep_graph=c in picked)

        # 3. Student step, once, on the accumulated gradient (summed over ranks: identical steps everywhere).
        t0 = time.perf_counter()
        acc.update(D.sum_dict(acc))  # shares of global means -> the global means (δ̄ included: same β everywhere)
        D.sum_gradients(self.trainable.parameters())
        distill_loss = acc["distill"]
        grad_theta = _grad_norm(self.trainable.parameters(), cfg.max_grad_norm)
        if math.isfinite(distill_loss) and math.isfinite(grad_theta):
            self.opt_theta.step()
            if self.ema_lm is not None:  # SDPO's EMA teacher follows the student
                M.update_ema(self.ema_lm, self.student, self.params.baselines.ema_decay)
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite student loss/gradient, update skipped")
        t1 = time.perf_counter()

        # 4. Composer: anchor term plus the latents' accumulated gradient, one backward through the resampler.
        flat = torch.zeros((0, width), device=device)
        anchor = torch.zeros(())
        self.opt_phi.zero_grad(set_to_none=True)
        order = [s for ss in slots for s in ss]  # per trajectory, as the teacher read them
        anchor_share = len(order) / max(D.global_sum([len(order)])[0], 1)  # this rank's rows of the anchor's mean
        if lat_leaf is not None and spec.composer_trainable:  # (φ = φ0 in the frozen-composer ablation)
            if lat_u is None:  # low_memory: the same forward again (φ unchanged, deterministic), now with a graph
                lat_u = self.composer(states, state_mask)
            flat = lat_u[order].reshape(-1, width)  # (Σ J_τ·K, D)
            anchor_u = self.anchor_latents([[t] for t in texts])  # φ0's (K, D) per distinct text
            anchor_target = torch.stack(anchor_u)[order].reshape(-1, width).to(flat.device)
            anchor = anchor_share * L.anchor_loss(flat, anchor_target)
            tensors, grads = [self.anchor_weight * anchor], [None]
            if lat_leaf.grad is not None:
                tensors.append(lat_u)
                grads.append(lat_leaf.grad)
            torch.autograd.backward(tensors, grads)
        elif lat_leaf is not None:  # φ = φ0: nothing to learn, but the dashboard still shows the latents' scale
            flat = lat_leaf[order].reshape(-1, width)
        anchor = torch.tensor(D.global_sum([float(anchor.detach())])[0])
        D.sum_gradients(self.composer.parameters())
        delta_bar = acc["delta"]
        loss_phi = float(L.composer_loss(torch.tensor(acc["kl"]), torch.tensor(delta_bar), beta=beta_used,
                                         margin=self.margin, anchor=anchor.detach(),
                                         anchor_weight=self.anchor_weight))
        grad_phi = _grad_norm(self.composer.parameters(), cfg.max_grad_norm)
        if math.isfinite(loss_phi) and math.isfinite(grad_phi):
            self.opt_phi.step()
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite composer loss/gradient, update skipped")
        t_end = time.perf_counter()
        phase["student"] += t1 - t0
        phase["composer"] += t_end - t1

        # 5. Dual ascent on β with this step's δ̄.
        if spec.composer_trainable and math.isfinite(delta_bar):  # β only acts on a composer that learns
            self.state.beta = L.dual_ascent(beta_used, margin=self.margin, delta_bar=delta_bar, lr=cfg.beta_lr)
        self.state.step += 1

        # Dashboard numbers (detached), from the sums the chunks accumulated.
        with torch.no_grad():
            # Whole-batch figures under data parallelism: every rank's trajectories, in rank (= task) order.
            rewards = torch.tensor(D.gather_lists(rewards.tolist()), dtype=torch.float32)
            successes = torch.tensor(D.gather_lists(successes.tolist()), dtype=torch.bool)
            per_traj_gap = torch.tensor(D.gather_lists((gap_sum.cpu() / counts.clamp(min=1)).tolist()))
            per_traj_kl = D.gather_lists((kl_sum.cpu() / counts.clamp(min=1)).tolist())
            norm_sum, norm_rows = D.global_sum([float(flat.detach().norm(dim=-1).sum()), flat.shape[0]])
            latent_norm = norm_sum / norm_rows if norm_rows else 0.0
            row = {
                "step": self.state.step, "rollouts": self.state.rollouts,
                "reward_mean": float(rewards.mean()), "success_rate": float(successes.float().mean()),
                "distill_loss": distill_loss, "kl_phi": acc["kl"], "delta": delta_bar, "beta": beta_used,
                "anchor": float(anchor), "student_entropy": acc["s_ent"] / n_tokens,
                "teacher_entropy": acc["t_ent"] / n_tokens, "topk_mass": acc["topk_mass"] / n_tokens,
                "grad_norm_theta": grad_theta, "grad_norm_phi": grad_phi,
                "latent_norm_ratio": latent_norm / max(self.embedding_norm, 1e-8),
                "step_seconds": time.perf_counter() - started,
            }
            diag = {
                "step": self.state.step,
                "margin_success": float(per_traj_gap[successes].mean()) if successes.any() else float("nan"),
                "margin_failure": float(per_traj_gap[~successes].mean()) if (~successes).any() else float("nan"),
                "latent_norm": latent_norm, "embedding_norm": self.embedding_norm,
                "skipped_updates": self.state.skipped_updates, "encoder_cache_hits": self.encoder.hits,
                "rollout_s": t_rollout - started, "teacher_s": phase["teacher"],
                "student_s": phase["student"], "composer_s": phase["composer"],
            }
            if not self.teacher_pass:  # no teacher: its columns have no value rather than a misleading 0
                row.update(kl_phi=math.nan, delta=math.nan, teacher_entropy=math.nan, topk_mass=math.nan)
        # Per trajectory (every rank's, in task order): mean over its action tokens of log p_T,φ − log p_S,old,
        # what δ(τ) weighs by A(τ) (benchmarks/margin_probe.py reads it to price margins and advantages).
        return {"row": row, "diagnostics": diag, "trajectory_gaps": per_traj_gap.tolist(),
                "trajectory_kl": per_traj_kl}

    def _teacher_lm(self):
        """The teacher's weights for this method: the frozen base θ̄, the live student or its EMA."""
        if self.method.teacher_weights == "frozen_base":
            return self.teacher.active()
        return nullcontext(self.ema_lm if self.method.teacher_weights == "ema" else self.student)

    def _context_embeddings(self, lm, texts: list[str | None]) -> list[torch.Tensor]:
        """Text contexts as (L, D) embeddings for the latent slot: spliced there they are exactly the same
        conversation with the text in its first user turn. None (no context) becomes an empty block."""
        embed = lm.get_input_embeddings()
        limit = self.params.composer.max_experience_tokens * self.params.bank.top_j
        out = []
        for text in texts:
            ids = self.tokenizer(text or "", add_special_tokens=False)["input_ids"][:limit]
            out.append(embed(torch.tensor(ids, dtype=torch.long, device=embed.weight.device)))
        return out

    def _composer_chunks(self, n_chunks: int) -> set[int]:
        """Which chunks train the composer this step (`lopd.composer_fraction`): a shuffle seeded by (seed,
        step), so a resumed run picks the same ones."""
        k = n_chunks if self.cfg.composer_fraction >= 1 else round(self.cfg.composer_fraction * n_chunks)
        k = max(k, 1 if self.cfg.composer_fraction > 0 else 0)
        order = list(range(n_chunks))
        random.Random(self.params.seed * 1_000_003 + self.state.step).shuffle(order)
        return set(order[:k])

    def _chunks(self, ids: list[list[int]]) -> list[list[int]]:
        return micro_batches([len(i) for i in ids], self.cfg.micro_batch,
                             chunk_group(self.cfg.samples_per_task, self.cfg.share_prompt))

    def anchor_latents(self, experiences: list[list[str]]) -> list[torch.Tensor]:
        """c_φ0 per task, from φ0's latents cached per experience text (φ0 never changes in a run)."""
        missing = list(dict.fromkeys(t for texts in experiences for t in texts if t not in self._anchor_cache))
        if missing:
            with torch.no_grad():
                fresh = compose_latents(self.anchor_composer, self.encoder, [[t] for t in missing])
            self._anchor_cache.update(zip(missing, fresh))
        width = self.composer.proj_out.out_features
        return [torch.cat([self._anchor_cache[t] for t in texts]) if texts else torch.zeros((0, width))
                for texts in experiences]

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.out_dir) / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        """Rank 0 writes the one checkpoint (every rank holds the same full state); the others wait for it."""
        path = self.checkpoint_path()
        if not D.is_main():
            D.barrier()
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "state": asdict(self.state),
            "trainable": {k: v for k, v in self.trainable.state_dict().items()},
            "composer": self.composer.state_dict(),
            "opt_theta": self.opt_theta.state_dict(),
            "opt_phi": self.opt_phi.state_dict(),
            "rng_torch": torch.get_rng_state(),
            "data_position": self.state.step * self.cfg.tasks_per_step,
            "ema": self.ema_lm.state_dict() if self.ema_lm is not None else None,  # SDPO's EMA teacher
        }
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)  # atomic: a crash mid-write leaves the previous checkpoint intact
        D.barrier()
        return path

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_path()
        if not path.exists():
            return False
        payload = torch.load(path, map_location="cpu", weights_only=False)
        self.trainable.load_state_dict(payload["trainable"])
        self.composer.load_state_dict(payload["composer"])
        self.opt_theta.load_state_dict(payload["opt_theta"])
        self.opt_phi.load_state_dict(payload["opt_phi"])
        if self.ema_lm is not None and payload.get("ema") is not None:
            self.ema_lm.load_state_dict(payload["ema"])
        torch.set_rng_state(payload["rng_torch"])
        self.state = DistillState(**payload["state"])
        return True


def _write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Rewrite the CSV with `rows` (atomic), so a resumed run never duplicates or loses a step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    tmp.replace(path)


DIVERGENCE_WINDOW = 20  # steps of reverse KL the alert compares against
DIVERGENCE_FACTOR = 10.0  # a KL this many times its recent median is a teacher pushed away, not a learning one


def margin_by_divergence(recent_kl: list[float], kl: float, delta: float, margin: float) -> bool:
    """Does this step meet δ̄ ≥ m only because the composer pushed the teacher away from the student?

    With most trajectories failing, A(τ) < 0 on most of the batch, and any teacher that differs from the student
    scores the student's own samples lower, so δ̄ rises with the reverse KL alone (README, "The privileged
    margin, β and `lopd.advantage`"). The sign of it: the margin met while the KL jumps to many times its recent
    median. Needs a full window of history, so the first steps (KL still falling from φ0) never alert.
    """
    if len(recent_kl) < DIVERGENCE_WINDOW or margin <= 0 or delta < margin:
        return False
    typical = sorted(recent_kl[-DIVERGENCE_WINDOW:])[DIVERGENCE_WINDOW // 2]
    return math.isfinite(kl) and kl > DIVERGENCE_FACTOR * max(typical, 1e-6)


def run_distill(distiller: Distiller, *, steps: int | None = None, resume: bool = True,
                stop_after: int | None = None) -> DistillState:
    """Train to `steps` (default lopd.steps); resume from the last checkpoint when there is one.
    `stop_after` ends the process early (tests of resumption)."""
    cfg = distiller.cfg
    total = steps or cfg.steps
    if resume and distiller.load_checkpoint():
        distiller.log(f"distill: resumed at step {distiller.state.step} (β={distiller.state.beta:.3f})")
    csv_path = Path(cfg.csv)
    diag_path = csv_path.with_name(csv_path.stem + "_diagnostics.csv")
    history = distiller.state.history
    while distiller.state.step < total:
        out = distiller.step()
        history.append({"row": out["row"], "diagnostics": out["diagnostics"]})  # (checkpointed: no per-trajectory lists)
        if D.is_main():  # rows are already whole-batch figures, equal on every rank
            _write_rows(csv_path, CSV_COLUMNS, [h["row"] for h in history])
            _write_rows(diag_path, DIAGNOSTIC_COLUMNS, [h["diagnostics"] for h in history])
        r = out["row"]
        distiller.log(f"distill: step {r['step']}/{total} reward {r['reward_mean']:.3f} success "
                      f"{r['success_rate']:.3f} loss {r['distill_loss']:.4f} δ̄ {r['delta']:+.4f} β {r['beta']:.3f} "
                      f"({r['step_seconds']:.1f}s)")
        recent = [h["row"]["kl_phi"] for h in history[-DIVERGENCE_WINDOW - 1:-1] if math.isfinite(h["row"]["kl_phi"])]
        if distiller.method.composer_trainable and margin_by_divergence(recent, r["kl_phi"], r["delta"],
                                                                        distiller.margin):
            distiller.log(f"distill: step {r['step']}: warning: δ̄ {r['delta']:.3f} ≥ m = {distiller.margin} only "
                          f"because the teacher moved away from the student (reverse KL {r['kl_phi']:.3f}, over "
                          f"{DIVERGENCE_FACTOR:g}× its median of the last {DIVERGENCE_WINDOW} steps): the student "
                          "is being distilled toward a worse teacher. See README, 'The privileged margin, β and "
                          "lopd.advantage'; lopd.advantage=group removes this incentive")
        if distiller.state.step % cfg.checkpoint_every == 0 or distiller.state.step == total:
            distiller.save_checkpoint()
        if stop_after is not None and distiller.state.step >= stop_after:
            break
    return distiller.state


def export(distiller: Distiller, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if D.is_main():  # replicas are identical: one copy on disk
        out.mkdir(parents=True, exist_ok=True)
        export_student(distiller.trainable, distiller.student, distiller.tokenizer, out)
        torch.save(distiller.composer.state_dict(), out.parent / "composer.pt")
    D.barrier()
    return out

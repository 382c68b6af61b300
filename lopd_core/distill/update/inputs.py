"""The typed inputs of every step function: one frozen `StepSetup` and one `StepModels` container.

Why: the trainer (`Distiller`, trainer.py) owns the models, the optimizers and the run's `DistillState`; the
functions of a step (update.py, reference.py, composer_step.py, dashboard.py, margin_pricing.py) take what they
read — the setup, the models, the state — and say so in their signature. None of them imports the trainer, so
the files of the step import each other in one direction only (tests/test_architecture.py checks that no file
imports itself back through others). torchtune's GRPO recipe passes typed containers between its stages the
same way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lopd_core.distill.composer.composer import Composer, ExperienceEncoder, compose_latents
from lopd_core.distill.composer.encoder_lora import lora_fingerprint
from lopd_core.distill.composer.lru import DEFAULT_CAPACITY, LRUCache
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.distill.scoring.teacher import Framing
from lopd_core.distill.update.anneal import step_scale
from lopd_core.distill.update.batch import RolloutBatch, rollout_batch
from lopd_core.distill.update.replay import IsReplay, never_replay
from lopd_core.distill.update.state import DistillState
from lopd_core.distill.update.step import StudentLoss
from lopd_core.envs import Task
from lopd_core.methods import MethodSpec, TeacherWeights
from lopd_core.sharding import Sharding

Retriever = Callable[[list[Task]], list[list[str]]]  # tasks -> experience texts per task


@dataclass(frozen=True)
class StepSetup:
    """What a step reads besides the models, fixed for one phase of a run: the resolved method, the student loss
    and each setting a step function reads, named, so that a function's inputs are visible in one place."""

    method: MethodSpec  # resolved once, in the distill driver (methods.resolve_method)
    student_loss: StudentLoss  # resolved from the method and the lopd section
    phase: int  # index of the method's phase this step trains (methods.method_phases)
    seed: int
    # the batch
    samples_per_task: int  # G: a task's consecutive samples (1 for a batch that holds served traces)
    advantage: str  # A(τ) of δ: continuous | binary | group
    group_std_eps: float  # GRPO's advantage (r − mean) / (std + eps)
    # the teacher
    top_k: int
    max_context: int  # rollout.max_context: no teacher pass reads more positions
    text_room: int  # tokens a text context may take at most: composer.max_experience_tokens × bank.top_j
    splice_room: int  # positions the latents' splice takes, reserved in the student's rollouts
    # the composer, β and the optimizers
    text_kl_weight: float
    text_kl_rows: int
    beta_lr: float
    margin_fraction: float  # `lopd.margin: auto`: the share of the priced gap m asks for
    max_grad_norm: float
    ema_decay: float
    # what update.py optimises (none of it asked: the trainer runs reference.py, `runs_reference`)
    micro_batch: int
    share_prompt: bool
    low_memory: bool
    teacher_micro_batch: int
    composer_fraction: float
    processes: int  # data-parallel ranks
    sharded: bool  # lopd.sharding: fsdp2

    @classmethod
    def of(cls, params, method: MethodSpec, phase: int, *, splice_room: int, processes: int) -> StepSetup:
        """The setup of `method` (a resolved phase) from the run's params, read once here."""
        lopd, b = params.lopd, params.baselines
        return cls(
            method=method,
            student_loss=StudentLoss.resolve(method, lopd, b),
            phase=phase,
            seed=params.seed,
            samples_per_task=lopd.samples_per_task,
            advantage=lopd.advantage,
            group_std_eps=b.group_std_eps,
            top_k=lopd.top_k,
            max_context=params.rollout.max_context,
            text_room=params.composer.max_experience_tokens * params.bank.top_j,
            splice_room=splice_room,
            text_kl_weight=lopd.text_kl_weight,
            text_kl_rows=lopd.text_kl_rows,
            beta_lr=lopd.beta_lr,
            margin_fraction=lopd.margin_fraction,
            max_grad_norm=lopd.max_grad_norm,
            ema_decay=b.ema_decay,
            micro_batch=lopd.micro_batch,
            share_prompt=lopd.share_prompt,
            low_memory=lopd.low_memory,
            teacher_micro_batch=lopd.teacher_micro_batch,
            composer_fraction=lopd.composer_fraction,
            processes=processes,
            sharded=lopd.sharding != "none",
        )

    @property
    def teacher_pass(self) -> bool:
        """GRPO without a reference KL runs no teacher."""
        return self.method.needs_teacher_pass

    @property
    def pg_advantage_eps(self) -> float | None:
        """The eps of GRPO's group-relative advantage where the loss has a policy-gradient term, else None."""
        return self.group_std_eps if self.student_loss.needs_pg_advantage else None

    def rollout_batch(self, state: DistillState, trajs: list, device) -> RolloutBatch:
        """The step's batch under this setup: A(τ), GRPO's advantage where the loss has a policy gradient, and
        the distillation term's weight where a reward-led arm gates it or anneals it (this step's, anneal.py)."""
        loss = self.student_loss
        return rollout_batch(
            trajs,
            samples_per_task=self.samples_per_task,
            advantage=self.advantage,
            group_std_eps=self.pg_advantage_eps,
            device=device,
            distill_gate=loss.distill_gate,
            distill_scale=step_scale(loss.anneal_window, state, trajs),
        )

    @property
    def runs_reference(self) -> bool:
        """The simple configuration, where the trainer runs reference.py's update itself: the whole batch at
        once (lopd.micro_batch 0), no prompt shared between a task's samples, no low-memory order, every chunk
        training φ, one process, nothing sharded. Each of these is an optimisation update.py adds."""
        return (
            self.micro_batch == 0
            and not self.share_prompt
            and not self.low_memory
            and self.composer_fraction >= 1
            and self.processes == 1
            and not self.sharded
        )

    def margin(self, state: DistillState) -> float | None:
        """The m this step trains with: the method's own (resolved: lopd.margin where it has none), or with
        `lopd.margin: auto` the priced one (None until the run priced it)."""
        own = self.method.composer.margin
        return own if own is not None else state.margin


class AnchorLatents:
    """φ0, fixed, and its latents per experience (and query: `StepModels.queries_of`), cached: the target of the
    composer's anchor term. The cache is bounded (lru.py) and keyed by φ0's encoder LoRA fingerprint too
    (encoder_lora.py): latents read under other LoRA weights are never served."""

    def __init__(self, composer: Composer, encoder: ExperienceEncoder, *, cache_capacity: int = DEFAULT_CAPACITY):
        self.composer = copy.deepcopy(composer).eval().requires_grad_(False)
        self.encoder = encoder
        # (φ0's LoRA fingerprint, query, experience) -> φ0's (K, D) latents
        self.cache: LRUCache[tuple[str, str, str], torch.Tensor] = LRUCache(cache_capacity)

    def __call__(self, experiences: list[list[str]], queries: list[str] | None = None) -> list[torch.Tensor]:
        """c_φ0 per task: (J·K, D), from the latents of each experience (read with its task's query, if any)."""
        lora = lora_fingerprint(self.composer.encoder_lora)
        units = [(lora, q, t) for q, texts in zip(queries or [""] * len(experiences), experiences) for t in texts]
        # this call's latents held apart from the cache: one call may read more than the cache keeps
        found = {u: v for u in dict.fromkeys(units) if (v := self.cache.get(u)) is not None}
        missing = list(dict.fromkeys(u for u in units if u not in found))
        if missing:
            asked = None if queries is None else [q for _, q, _ in missing]
            with torch.no_grad():
                fresh = compose_latents(self.composer, self.encoder, [[t] for _, _, t in missing], asked)
            for unit, latents in zip(missing, fresh):
                self.cache.put(unit, latents)
                found[unit] = latents
        out, start = [], 0
        for texts in experiences:
            rows = [found[u] for u in units[start : start + len(texts)]]
            out.append(torch.cat(rows) if rows else torch.zeros((0, self.composer.proj_out.out_features)))
            start += len(texts)
        return out

    def clear(self) -> None:
        """φ0's latents are of the teacher base's encodings: dropped when a refresh replaces the base."""
        self.cache.clear()


@dataclass
class StepModels:
    """The weights a step reads and trains, their optimizers, and what turns a task into the teacher's input.
    Built and owned by the trainer; a step function changes the weights and the optimizers' state, nothing else."""

    trainable: torch.nn.Module  # what opt_theta steps: the student LM, or its PEFT wrapper
    student: torch.nn.Module  # the causal LM the student samples and is scored with
    teacher: TeacherView  # θ̄, the frozen base
    ema: torch.nn.Module | None  # SDPO's EMA teacher (teacher.weights: ema)
    composer: Composer  # φ
    anchor: AnchorLatents  # φ0's latents
    encoder: ExperienceEncoder  # the frozen base's states of experience texts, cached
    opt_theta: torch.optim.Optimizer
    opt_phi: torch.optim.Optimizer
    sharding: Sharding
    retriever: Retriever
    tokenizer: Any
    framing: Framing  # where the latents are spliced
    embedding_norm: float  # mean token-embedding norm: the scale the dashboard reads the latents against
    is_replay: IsReplay = never_replay  # a replay task (replay.py) reads no experience

    @property
    def device(self) -> torch.device:
        return self.composer.queries.device

    @property
    def latent_width(self) -> int:
        return self.composer.proj_out.out_features

    def retrieve(self, tasks: list[Task]) -> list[list[str]]:
        """The retriever's experience texts per task, and none for a replay task (replay.py): its teacher reads
        nothing, so the student is held to the teacher's weights alone there. The retriever is asked only about
        the other tasks (all of them when nothing is replayed)."""
        asked = [i for i, t in enumerate(tasks) if not self.is_replay(t)]
        out: list[list[str]] = [[] for _ in tasks]
        if asked:
            for i, texts in zip(asked, self.retriever([tasks[i] for i in asked])):
                out[i] = texts
        return out

    def queries_of(self, tasks: list[Task]) -> list[str] | None:
        """What φ reads in front of each task's experiences: its instruction for a query-conditioned composer,
        else None (composer.py)."""
        return [t.instruction for t in tasks] if self.composer.reads_query else None

    def teacher_lm(self, weights: TeacherWeights):
        """The teacher's weights, as a context manager: the frozen base θ̄, the live student or its EMA."""
        if weights == "frozen_base":
            return self.teacher.active()
        return nullcontext(self.ema if weights == "ema" else self.student)

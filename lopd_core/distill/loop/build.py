"""A distillation run's models built from the settings: the student θ, the frozen teacher θ̄, the composer φ and
φ0, their optimizers and sharding (`build_models`), and the checks that must pass before anything is built.

Why apart from the trainer: building reads many settings once; the trainer then only owns what was built and
calls the step's functions with it (inputs.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.config import ConfigError, Params
from lopd_core.distill.composer import composer as CP
from lopd_core.distill.composer.composer import Composer, ExperienceEncoder, mean_embedding_norm
from lopd_core.distill.scoring.models import TeacherView, make_student_and_teacher
from lopd_core.distill.scoring.teacher import Framing
from lopd_core.distill.teacher import baselines as B
from lopd_core.distill.update.inputs import AnchorLatents, Retriever, StepModels
from lopd_core.distill.update.replay import IsReplay, never_replay
from lopd_core.methods import MethodSpec


def load_composer(path: str | Path, model, cfg) -> Composer:
    """φ of the composer section (`cfg`) for `model`, loaded from `path`; a fresh one when there is no file (a
    method whose teacher reads no latents still owns a composer, unused)."""
    composer = CP.build_composer(cfg, model)
    if path and Path(path).exists():
        CP.load_weights(composer, path)
    return composer


def check_processes(lopd) -> None:
    """lopd.tasks_per_step against the processes of the run (after `D.setup()`): every rank needs a task per step."""
    if D.world_size() > lopd.tasks_per_step:
        raise ValueError(
            f"lopd.tasks_per_step: got {lopd.tasks_per_step}, expected at least the "
            f"number of processes ({D.world_size()}): every rank needs a task per step"
        )


def check_top_k(lopd, model) -> None:
    """lopd.top_k against the model's vocabulary: checked as soon as the model is loaded (`run_lopd`), before
    anything else could fail first and hide the setting behind another error."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if lopd.student_loss == "topk" and lopd.top_k >= vocab:
        raise ConfigError(
            f"lopd.top_k: got {lopd.top_k}, expected fewer than the model's vocabulary "
            f"({vocab}); for the whole distribution set lopd.student_loss=full"
        )


def splice_room(params: Params, phases: tuple[MethodSpec, ...], num_queries: int) -> int:
    """Positions the teacher splices into a trajectory (its latents and their frame), reserved in the student's
    rollouts so that no teacher pass reads more than rollout.max_context (text contexts are cut to fit)."""
    room = max(3 + params.bank.top_j * num_queries if m.needs_composer else 0 for m in phases)
    if params.rollout.max_context - room < params.rollout.max_new_tokens + 1:
        raise ConfigError(
            f"rollout.max_context: got {params.rollout.max_context}, expected more than the "
            f"teacher's {room} spliced positions (bank.top_j × composer.num_queries + 3) "
            f"plus rollout.max_new_tokens ({params.rollout.max_new_tokens})"
        )
    return room


def build_models(
    params: Params,
    phases: tuple[MethodSpec, ...],
    base,
    tokenizer,
    *,
    retriever: Retriever,
    composer: Composer,
    teacher_base=None,
    is_replay: IsReplay = never_replay,
) -> StepModels:
    """θ (the student), θ̄ (the frozen teacher; `teacher_base`: other weights than the student's start, as
    `lopd cycle` with cycle.refresh_teacher false keeps the first base), φ and φ0, and their optimizers.
    `is_replay`: which tasks are replayed (replay.py): the step does not ask `retriever` about them."""
    cfg, first = params.lopd, phases[0]
    trainable, student, teacher = make_student_and_teacher(
        base, mode=cfg.student_mode, lora_rank=cfg.lora_rank, teacher=teacher_base
    )
    encoder = ExperienceEncoder(teacher, tokenizer, max_tokens=params.composer.max_experience_tokens)
    composer = composer.train().requires_grad_(first.composer.trainable)
    if composer.encoder_lora is not None:  # fixed here: the encoder's states are cached (encoder_lora.py)
        composer.encoder_lora.requires_grad_(False)
    ema = B.ema_copy(student) if first.teacher.weights == "ema" else None
    anchor = AnchorLatents(composer, encoder)  # φ0, fixed
    embedding_norm = mean_embedding_norm(student)
    sharding = shard(params, phases, student, teacher)  # before the optimizer: it must hold the sharded parameters
    opt_theta = torch.optim.AdamW(
        [p for p in trainable.parameters() if p.requires_grad], lr=cfg.lr_student, weight_decay=0.0
    )
    opt_phi = torch.optim.AdamW(composer.parameters(), lr=cfg.lr_composer, weight_decay=0.0)
    framing = Framing.from_tokenizer(tokenizer)
    return StepModels(
        trainable,
        student,
        teacher,
        ema,
        composer,
        anchor,
        encoder,
        opt_theta,
        opt_phi,
        sharding,
        retriever,
        tokenizer,
        framing,
        embedding_norm,
        is_replay,
    )


def shard(params: Params, phases: tuple[MethodSpec, ...], student, teacher: TeacherView) -> SH.Sharding:
    """`lopd.sharding: fsdp2`: the student's causal LM and a separate teacher copy sharded (sharding.py)."""
    if params.lopd.sharding == "none":
        return SH.Sharding([])
    unsupported = [m.name for m in phases if m.teacher.weights == "ema" or m.teacher.refresh == "gated"]
    if unsupported:
        raise ConfigError(
            f"lopd.sharding: got 'fsdp2' with lopd.method={params.lopd.method!r}, expected 'none': "
            f"the teacher of {', '.join(unsupported)} copies the student's weights, which a "
            "sharded student does not hold whole"
        )
    ro = params.rollout
    if ro.backend == "openai" and ro.sync == "reload":
        raise ConfigError(
            "lopd.sharding: got 'fsdp2' with rollout.backend='openai' and rollout.sync='reload', "
            "expected 'none': the reload saves the student whole from one process, which a "
            "sharded student is not (rollout.sync=none keeps the servers' weights as they are)"
        )
    SH.setup()
    teacher_modules = [] if teacher.adapter_owner is not None else SH.shard_lm(teacher.lm)
    return SH.Sharding(SH.shard_lm(student), teacher_modules)

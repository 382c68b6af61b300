"""What the functions of one update share (update.py, composer_step.py): the teacher's context for the step's
trajectories (step 2a's result), the frozen container `UpdateParts` each function reads, the phase timer and
the clipped gradient norm.

LOPD's teacher reads composer latents c_φ of the retrieved experiences; the baselines' teachers read text (the
same experiences, the oracle's solution, a successful sibling, a skill) or nothing, in the same slot
(methods.py). update.py's `teacher_context` composes latents once per distinct experience text; the chunks'
teacher backward stops at a detached leaf (`TeacherContext.latents`), whose accumulated gradient is pushed through
the resampler once, after the last chunk (composer_step.py). A file of its own so that update.py and
composer_step.py both read these types without importing each other.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lopd_core import sharding as SH
from lopd_core.distill.update import step as S
from lopd_core.distill.update.batch import RolloutBatch
from lopd_core.distill.update.inputs import StepModels, StepSetup


@dataclass
class TeacherContext:
    """What the teacher reads in its latent slot this step, per trajectory (step 2a)."""

    latents: torch.Tensor | None  # (U, K, D) detached leaf, one row per distinct experience: grads gather here
    slots: list[list[int]]  # per trajectory, the rows of `latents` it reads (J each; none without experience)
    texts: list[str]  # the distinct experience texts, in `latents` order
    queries: list[str] | None  # what φ read in front of each (its task's instruction), or None (composer.py)
    text_context: list[str | None] | None  # per trajectory, the text a baseline's teacher reads instead
    signal: torch.Tensor | None  # (B,) 0 where the teacher has no context and so no signal (SDPO), else None
    n_signal: int  # action tokens of the trajectories with signal, every rank's: the student loss's denominator
    composed: torch.Tensor | None  # (U, K, D) the resampler's output with its graph, when kept from the start
    encoded: tuple[torch.Tensor, torch.Tensor] | None  # the experiences' encoder states, to run it again

    def row_latents(self, i: int, models: StepModels) -> torch.Tensor:
        """(J·K, D) the latents trajectory i's teacher reads; zero rows (no block) when it retrieved nothing."""
        if not self.slots[i]:
            return torch.zeros((0, models.latent_width), device=models.device)
        return self.latents[self.slots[i]].reshape(-1, models.latent_width)


@dataclass(frozen=True)
class UpdateParts:
    """What every function of one update reads, fixed for the update (the weights and the sums change, not which
    they are): each function of update.py and composer_step.py takes this and what is its own (a chunk's rows, a
    pass's scores)."""

    setup: StepSetup
    models: StepModels
    batch: RolloutBatch
    context: TeacherContext
    sums: S.StepSums


def grad_norm(params, max_norm: float) -> float:
    """The gradient norm before clipping (of the full tensors, where the student is sharded), after clipping."""
    return float(SH.full_value(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)))


@contextmanager
def timed(sums: S.StepSums, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        sums.seconds[phase] += time.perf_counter() - started


def context_embeddings(
    setup: StepSetup, tokenizer, lm, texts: list[str | None], lengths: list[int] | None = None
) -> list[torch.Tensor]:
    """Text contexts as (L, D) embeddings for the latent slot: spliced there they are exactly the same
    conversation with the text in its first user turn. None or "" (no context) is zero rows: no block, the
    plain conversation (teacher.embed_row). With the rows' `lengths`, a text is cut to what fits beside its
    row within rollout.max_context (nothing: no block)."""
    embed = lm.get_input_embeddings()
    out = []
    for k, text in enumerate(texts):
        room = setup.text_room if lengths is None else min(setup.text_room, setup.max_context - lengths[k] - 3)
        ids = tokenizer(text or "", add_special_tokens=False)["input_ids"][: max(room, 0)]
        out.append(embed(torch.tensor(ids, dtype=torch.long, device=embed.weight.device)))
    return out

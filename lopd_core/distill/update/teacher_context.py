"""Step 2a: what the teacher reads in its latent slot, per trajectory, and with which weights.

LOPD's teacher reads composer latents c_φ of the retrieved experiences; the baselines' teachers read text (the
same experiences, the oracle's solution, a successful sibling, a skill) or nothing, in the same slot
(methods.py). Latents are composed once per distinct experience text (per task and text, for a composer that
reads the task in front: composer.py): the G samples of a task (and tasks sharing a bank row) read the same
texts, and the resampler treats each experience independently. The chunks'
teacher backward stops at a detached leaf (`TeacherContext.latents`); its accumulated gradient is pushed through
the resampler once, after the last chunk (update.py, `step_composer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopd_core import distributed as D
from lopd_core.distill.teacher import baselines as B
from lopd_core.distill.update.batch import RolloutBatch
from lopd_core.distill.update.inputs import StepModels, StepSetup
from lopd_core.envs import Task


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


def teacher_context(
    setup: StepSetup, models: StepModels, tasks: list[Task], trajs: list, batch: RolloutBatch
) -> TeacherContext:
    """Retrieve, and compose latents once per distinct experience text (module docstring)."""
    spec, group, device = setup.method, setup.samples_per_task, models.device
    per_task = models.retrieve(tasks) if spec.uses_bank else [[] for _ in tasks]
    # Baselines whose teacher reads text (or nothing) instead of latents: the composer reads nothing.
    text_context = B.text_contexts(spec, tasks, trajs, per_task, group)  # (B,) or None
    experiences = [per_task[i // group] if spec.needs_composer else [] for i in range(len(trajs))]
    # A trajectory without a context (SDPO's groups without a success) gives no signal: its tokens leave
    # the student loss and its normaliser. (Decided by the method, so every rank takes the same branch.)
    signal, n_signal = None, batch.n_tokens
    if spec.teacher.may_lack_context:
        has = torch.tensor([c is not None for c in text_context])
        signal = has.float().to(device)
        n_signal = max(int(D.global_sum([int(batch.token_counts[has].sum())])[0]), 1)
    # one latent row per distinct (query, experience): with a query-conditioned φ, per task and experience
    asked = models.queries_of([tasks[i // group] for i in range(len(trajs))]) or [""] * len(trajs)
    units = list(dict.fromkeys((asked[i], t) for i, ex in enumerate(experiences) for t in ex))
    slot = {u: i for i, u in enumerate(units)}
    texts = [t for _, t in units]
    queries = [q for q, _ in units] if models.composer.reads_query else None
    slots = [[slot[(asked[i], t)] for t in ex] for i, ex in enumerate(experiences)]
    context = TeacherContext(None, slots, texts, queries, text_context, signal, n_signal, None, None)
    if texts:
        states, state_mask = models.encoder.encode(texts, queries, lora=models.composer.encoder_lora)
        context.encoded = (states.to(device), state_mask.to(device))
        if setup.low_memory or not spec.composer.trainable:  # graph rebuilt at the end (or never: φ = φ0)
            with torch.no_grad():
                context.latents = models.composer(*context.encoded)
        else:
            context.composed = models.composer(*context.encoded)  # (U, K, D), graph to φ
            context.latents = context.composed.detach()
        context.latents.requires_grad_(spec.composer.trainable)
    return context


def row_latents(models: StepModels, context: TeacherContext, i: int) -> torch.Tensor:
    """(J·K, D) the latents trajectory i's teacher reads; zero rows (no block) when it retrieved nothing."""
    if not context.slots[i]:
        return torch.zeros((0, models.latent_width), device=models.device)
    return context.latents[context.slots[i]].reshape(-1, models.latent_width)


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


def rows_context(
    setup: StepSetup, models: StepModels, lm, context: TeacherContext, ids: list[list[int]], *, rows: list[int]
):
    """The contexts the teacher splices into `rows` (whose ids are `ids`), and the keys that tell a shared
    prompt pass which rows read the same context; (None, None) for a teacher that reads nothing."""
    if setup.method.needs_composer:
        ctx = [row_latents(models, context, i) for i in rows]
        return ctx, [tuple(context.slots[i]) for i in rows]  # equal slots: the same latent rows
    if context.text_context is not None:
        texts = [context.text_context[i] for i in rows]
        ctx = context_embeddings(setup, models.tokenizer, lm, texts, [len(r) for r in ids])
        return ctx, [(context.text_context[i], c.shape[0]) for i, c in zip(rows, ctx)]  # the text as cut
    return None, None


def check_teacher_rows(setup: StepSetup, ids: list[list[int]], ctx: list[torch.Tensor] | None) -> None:
    """No teacher pass reads more than rollout.max_context positions (the student's rollouts leave room for
    the splice, `splice_room`); a longer row is a trajectory from elsewhere, named rather than scored."""
    limit = setup.max_context
    for k, row in enumerate(ids):
        spliced = 0 if ctx is None or ctx[k].shape[0] == 0 else ctx[k].shape[0] + 3
        if len(row) + spliced > limit:
            raise ValueError(
                f"a trajectory of {len(row)} tokens with the teacher's {spliced} spliced positions "
                f"exceeds rollout.max_context={limit}: roll it out with max_context reduced by "
                f"Distiller.splice_room ({setup.splice_room})"
            )

"""The latent teacher acting: the frozen base plays tasks with latents spliced into its first user turn.

Distillation can move the student at most as far as the teacher is better than it, so the first question about
a composer is whether the teacher it conditions actually plays better than the base alone — and better than the
base reading the same experiences as text, the upper reference the composer is cold-started toward. Training
scores the teacher only on the student's tokens (teacher-forced); this plays it end to end, with the same
splice (`teacher.embed_row`), so its success rate is the ceiling a distillation run can approach.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_core.distill.composer.composer import Composer, ExperienceEncoder, compose_latents
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.distill.scoring.teacher import Framing, embed_row
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, Trajectory, rollout


@torch.no_grad()
def task_latents(
    model,
    tokenizer,
    composer: Composer,
    experiences: list[list[str]],
    *,
    max_tokens: int,
    queries: list[str] | None = None,
) -> list[Tensor]:
    """(J·K, D) latents per task from its experience texts, read by `model` (the frozen base) and `composer`;
    `queries`: the tasks' instructions, for a composer that reads them (composer.query_conditioned)."""
    encoder = ExperienceEncoder(TeacherView(model), tokenizer, max_tokens=max_tokens)
    return compose_latents(composer.eval(), encoder, experiences, queries)


def latent_rollout(
    model,
    tokenizer,
    requests: list[RolloutRequest],
    latents: list[Tensor],
    *,
    sampling: Sampling,
    batch_size: int = 32,
    seed: int = 0,
) -> list[Trajectory]:
    """Play `requests` with `latents[i]` in request i's latent slot (the requests carry no text experiences)."""
    if len(latents) != len(requests):
        raise ValueError(f"latents: got {len(latents)} for {len(requests)} requests")
    if any(r.experiences for r in requests):
        raise ValueError("a latent teacher reads its experiences as latents, not as text")
    framing = Framing.from_tokenizer(tokenizer)
    embed = model.get_input_embeddings()

    def embedder(index: int, token_ids: list[int]) -> Tensor:
        return embed_row(embed, token_ids, latents[index], framing)[0]

    return rollout(
        model,
        make_chat(tokenizer),
        requests,
        sampling=sampling,
        batch_size=batch_size,
        seed=seed,
        context_embedder=embedder,
    )

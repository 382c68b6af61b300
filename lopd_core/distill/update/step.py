"""The pieces of one LOPD training step (DESIGN §3, steps 2-5): typed containers between the phases and pure
functions for their arithmetic. `update.update` (update.py) composes them in the order of the algorithm:

  rollout_batch      trajectories -> `RolloutBatch`: ids, masks, sampling log-probs, advantages, normalisers
  score_teacher      step 2 on some rows -> `TeacherScores` (graph to the latents when the caller keeps one);
                     `.targets()` is the detached `StudentTargets` the student loss reads
  student_token_loss step 3: the student's per-token loss for its `StudentLoss` (resolved once per run)
  composer_terms     step 4: per-token KL(sg[p_S,old] ‖ p_T,φ) and per-trajectory δ(τ) on the same scores
  StepSums           each chunk's share of the batch's means, and per-trajectory sums for the diagnostics

What each mean is divided by, and why:
  * the student loss and the composer's KL are token means over the whole batch (every rank's tokens): each
    chunk's sum is divided by `RolloutBatch.n_tokens` (or `TeacherContext.n_signal` where trajectories without a
    teacher context drop out), so chunk gradients add up to the whole batch's;
  * δ̄ is a mean over trajectories (every rank's): each chunk's Σ δ(τ) is divided by `RolloutBatch.n_scored`,
    the trajectories with at least one action token (losses.py says why a trajectory is one vote).
Both denominators are known before the first chunk runs and are clamped to ≥ 1.

Shapes: B trajectories (this rank's), c trajectories of a chunk, n action tokens of a chunk, V vocabulary,
k top-k, U distinct experience texts, K latents per experience, D width.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
from torch import Tensor

from lopd_core import distributed as D
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring import pg_losses as PG
from lopd_core.distill.scoring.prefix import score_actions_shared
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch

# topk | full | sampled: distillation toward the teacher; grpo | grpo+kl | rlsd: a policy gradient (+ Skill-SD's
# KL; RLSD's teacher-sized advantages)
StudentLossKind = Literal["topk", "full", "sampled", "grpo", "grpo+kl", "rlsd"]
STUDENT_LOSSES: tuple[str, ...] = get_args(StudentLossKind)
POLICY_GRADIENT_LOSSES = ("grpo", "grpo+kl", "rlsd")


# ---- step 2: the teacher ------------------------------------------------------------------------------------


@dataclass
class StudentTargets:
    """The teacher's detached outputs the student loss reads, for n action tokens."""

    topk_logprobs: Tensor  # (n, k) the teacher's full-vocabulary log-probs at its top-k ids
    topk_ids: Tensor  # (n, k)
    action_logprobs: Tensor  # (n,) the teacher's log-prob of the sampled token
    logits: Tensor | None = None  # (n, V), kept only for student_loss = full

    @staticmethod
    def cat(parts: list[StudentTargets]) -> StudentTargets:
        """Targets of consecutive passes over a chunk's rows, as one (their tokens are in row order)."""
        return StudentTargets(
            torch.cat([p.topk_logprobs for p in parts]),
            torch.cat([p.topk_ids for p in parts]),
            torch.cat([p.action_logprobs for p in parts]),
            None if parts[0].logits is None else torch.cat([p.logits for p in parts]),
        )


@dataclass
class TeacherScores:
    """The teacher's scores of n action tokens, reduced to what steps 3 and 4 read: (n, k + 1) and (n,) tensors,
    not its (n, V) log-probs. `support_logprobs`, `tail_logprob` and `action_logprobs` keep the graph to the
    latents when the pass ran with one (step 4 back-propagates through them); the top-k is detached."""

    action_ids: Tensor  # (n,)
    token_traj_index: Tensor  # (n,) row of each token within the scored rows
    logits: Tensor | None  # (n, V) divided by the teacher temperature; kept only for student_loss = full
    support_logprobs: Tensor  # (n, k) log-probs at the top-k ids (the values of topk_logprobs, with the graph)
    tail_logprob: Tensor  # (n,) log of the mass outside the top-k ids
    action_logprobs: Tensor  # (n,)
    topk_logprobs: Tensor  # (n, k)
    topk_ids: Tensor  # (n, k)
    entropy_sum: float  # Σ over the n tokens of the teacher's entropy

    def targets(self, keep_logits: bool) -> StudentTargets:
        if keep_logits and self.logits is None:
            raise ValueError("TeacherScores: the logits were not kept (score_teacher(keep_logits=True))")
        return StudentTargets(
            self.topk_logprobs,
            self.topk_ids,
            self.action_logprobs.detach(),
            self.logits.detach() if keep_logits else None,
        )


@dataclass
class StudentOld:
    """The pre-update student's detached log-probs where step 4 reads them — at the teacher's top-k ids, outside
    them, at the sampled token — (n, k + 1) and (n,) in place of its (n, V) log-probs."""

    support_logprobs: Tensor  # (n, k)
    tail_logprob: Tensor  # (n,)
    action_logprobs: Tensor  # (n,)

    @staticmethod
    def of(logprobs: Tensor, support_ids: Tensor, action_ids: Tensor) -> StudentOld:
        """logprobs (n, V) the student's detached log-softmax; support_ids (n, k); action_ids (n,)."""
        return StudentOld(
            logprobs.gather(-1, support_ids),
            L.tail_logsumexp(logprobs, support_ids),
            logprobs.gather(-1, action_ids[:, None]).squeeze(-1),
        )


def score_teacher(
    lm,
    token_ids: list[list[int]],
    action_masks: list[list[int]],
    context: list[Tensor] | None,
    context_keys: list[Hashable] | None,
    *,
    framing: Framing,
    share_prompt: bool,
    top_k: int,
    temperature: float = 1.0,
    keep_logits: bool = False,
) -> TeacherScores:
    """Step 2 on some rows: the teacher reads each row's context (latents or text embeddings, or nothing) in its
    latent slot and scores the row's action tokens. One log-softmax serves the top-k, the composer's KL and δ;
    only its (n, k + 1) and (n,) reductions leave this function (the graph keeps the log-softmax itself for the
    backward), and the logits only with `keep_logits` (the full-vocabulary student loss reads them).
    The graph follows the caller's grad mode: run under torch.no_grad() when nothing back-propagates."""
    if share_prompt:  # each task's prompt and latents once for its samples (prefix.py)
        scored = score_actions_shared(
            lm, token_ids, action_masks, context=context, framing=framing, context_keys=context_keys
        )
        logits, action_ids, rows = scored.logits, scored.action_ids, scored.token_traj_index
    else:
        batch = build_batch(lm, token_ids, action_masks, context, framing)
        logits, action_ids, rows = action_logits(lm, batch), batch.action_ids, batch.token_traj_index
    if temperature != 1.0:  # the sharpened-teacher control
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)  # (n, V), differentiable w.r.t. the latents
    detached = logprobs.detach()
    top_lp, top_ids = detached.topk(min(top_k, detached.shape[-1]), dim=-1)  # (n, k)
    action_lp = logprobs.gather(-1, action_ids[:, None]).squeeze(-1)  # (n,)
    entropy_sum = float(-(detached.exp() * detached).sum())
    return TeacherScores(
        action_ids,
        rows,
        logits if keep_logits else None,
        logprobs.gather(-1, top_ids),
        L.tail_logsumexp(logprobs, top_ids),
        action_lp,
        top_lp,
        top_ids,
        entropy_sum,
    )


# ---- step 3: the student ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudentLoss:
    """Which student loss a run takes, resolved once from the method and the config (`resolve`)."""

    kind: StudentLossKind
    importance_cap: float | None = None  # weight the sampled-token reverse KL by min(p_S/p_sample, cap); None: off
    clip: float = 0.2  # PPO-clip ε
    reference_kl: float = 0.0  # GRPO: weight of the k3 KL to the frozen base
    skill_kl: float = 0.0  # Skill-SD: weight of the sampled-token reverse KL to its teacher
    rl_weight: float = 0.0  # lopd_rl: weight of the GRPO term added to the distillation loss
    kl_mix: float = 0.0  # w of the top-k loss (1 − w)·KL(p_S ‖ p_T) + w·KL(p_T ‖ p_S); 0: the reverse KL alone
    rlsd_clip: float = 0.5  # lopd_rlsd: the teacher's per-token scale of the advantage stays in [1 − c, 1 + c]
    # lopd_rl_silent / _annealed: the batch's `distill_weight` scales the KL term — the gate on the group's rewards
    # (None: no weight at all) and the anneal's window of recent steps (0: no anneal; anneal.py)
    distill_gate: str | None = None
    anneal_window: int = 0

    @classmethod
    def resolve(cls, method, lopd, baselines) -> StudentLoss:
        """`method` a resolved MethodSpec (its `student` part is read); `lopd`, `baselines` the config sections
        (checked at load)."""
        setup = method.student
        kind = lopd.student_loss if setup.distills else setup.loss
        if kind not in STUDENT_LOSSES:
            raise ValueError(f"unknown student loss {kind!r}; expected one of {', '.join(STUDENT_LOSSES)}")
        if setup.distills and setup.kl_mix > 0 and kind != "topk":
            raise ValueError(
                f"{method.name}: the forward/reverse mix (kl_mix {setup.kl_mix:g}) is a top-k loss, "
                f"got lopd.student_loss={kind!r}"
            )
        return cls(
            kind,
            lopd.importance_cap if lopd.importance_weight else None,
            baselines.grpo_clip,
            setup.reference_kl,
            baselines.skill_kl if setup.adds_sampled_kl else 0.0,
            baselines.rl_weight if setup.adds_policy_gradient else 0.0,
            setup.kl_mix if setup.distills else 0.0,
            baselines.rlsd_clip,
            setup.distill_gate if setup.weighs_distillation else None,
            baselines.anneal_window if setup.anneal else 0,
        )

    @property
    def reads_sample_logprobs(self) -> bool:
        return self.kind in POLICY_GRADIENT_LOSSES or self.importance_cap is not None or self.rl_weight > 0

    @property
    def reads_teacher_logits(self) -> bool:
        return self.kind == "full"

    @property
    def needs_pg_advantage(self) -> bool:
        """A policy-gradient term (GRPO, Skill-SD, lopd_rl's): the batch carries group-relative advantages."""
        return self.kind in POLICY_GRADIENT_LOSSES or self.rl_weight > 0


def student_token_loss(
    student_logits: Tensor,
    action_ids: Tensor,
    targets: StudentTargets | None,
    loss: StudentLoss,
    *,
    pg_advantage: Tensor | None = None,
    sample_logprobs: Tensor | None = None,
    distill_weight: Tensor | None = None,
) -> Tensor:
    """Step 3's per-token loss (n,) on a chunk: student_logits (n, V) with grad; targets from the teacher (None
    only for GRPO without a reference KL); pg_advantage (n,) each token's trajectory advantage (GRPO);
    sample_logprobs (n,) the rollout's sampling log-probs (GRPO's p_old, and the importance weight's p_sample);
    distill_weight (n,) the distillation term's weight per token (its trajectory's `RolloutBatch.distill_weight`:
    the reward-led arms' gate or anneal; None: 1).

    The importance weight multiplies the sampled-token reverse KL only: the one term whose value depends on the
    sampled token (losses.py). GRPO's own ratio is against the sampling log-probs, so it needs no weight."""
    if loss.rl_weight > 0:  # lopd_rl: the distillation loss plus the GRPO term on the same tokens
        distill = student_token_loss(
            student_logits, action_ids, targets, replace(loss, rl_weight=0.0), sample_logprobs=sample_logprobs
        )
        if distill_weight is not None:  # lopd_rl_silent, lopd_rl_annealed: a gated or fading teacher
            distill = distill * distill_weight
        s_action = torch.log_softmax(student_logits, -1).gather(-1, action_ids[:, None]).squeeze(-1)  # (n,)
        return distill + loss.rl_weight * PG.clipped_policy_loss(
            s_action, sample_logprobs, pg_advantage, clip=loss.clip
        )
    if loss.kind == "topk":
        if loss.kl_mix > 0:  # the forward-KL and mixed arms (lopd.kl_mix)
            return L.mixed_kl_topk(student_logits, targets.topk_logprobs, targets.topk_ids, weight=loss.kl_mix)
        return L.reverse_kl_topk(student_logits, targets.topk_logprobs, targets.topk_ids)
    if loss.kind == "full":
        return L.reverse_kl_full(student_logits, targets.logits)
    s_action = torch.log_softmax(student_logits, -1).gather(-1, action_ids[:, None]).squeeze(-1)  # (n,)
    weight = (
        1.0
        if loss.importance_cap is None
        else L.truncated_importance_weight(s_action, sample_logprobs, cap=loss.importance_cap)
    )
    if loss.kind == "sampled":
        return weight * L.reverse_kl_sampled(s_action, targets.action_logprobs)
    if loss.kind == "rlsd":  # the reward's sign, the teacher's clipped ratio as each token's size
        scale = PG.rlsd_token_scale(targets.action_logprobs, s_action, pg_advantage, clip=loss.rlsd_clip)
        return PG.clipped_policy_loss(s_action, sample_logprobs, pg_advantage * scale, clip=loss.clip)
    per_token = PG.clipped_policy_loss(s_action, sample_logprobs, pg_advantage, clip=loss.clip)
    if loss.reference_kl > 0 and targets is not None:  # GRPO's KL to the frozen base (baselines.grpo_kl)
        per_token = per_token + loss.reference_kl * PG.reference_kl_k3(s_action, targets.action_logprobs)
    if loss.kind == "grpo+kl":  # Skill-SD: plus a small sampled-token reverse KL to its teacher
        per_token = per_token + loss.skill_kl * weight * L.reverse_kl_sampled(s_action, targets.action_logprobs)
    return per_token


# ---- step 4: the composer -----------------------------------------------------------------------------------


@dataclass
class ComposerTerms:
    """Step 4's terms on the rows of one teacher pass (graph to the latents where the scores have one)."""

    kl_tokens: Tensor  # (n,) KL(sg[p_S,old] ‖ p_T,φ) on the teacher's top-k + tail
    delta: Tensor  # (c,) δ(τ) per scored row (0 for a row without action tokens)
    gap: Tensor  # (n,) detached log p_T,φ(a) − log p_S,old(a) of the sampled tokens


def composer_terms(scores: TeacherScores, student_old: StudentOld, advantage: Tensor) -> ComposerTerms:
    """student_old: the pre-update student's detached log-probs at the same tokens, on the teacher's top-k ids;
    advantage (c,) A(τ) of the scored rows."""
    kl_tokens = L.support_kl(
        student_old.support_logprobs, student_old.tail_logprob, scores.support_logprobs, scores.tail_logprob
    )  # (n,)
    delta = L.privileged_margin_delta(
        scores.action_logprobs, student_old.action_logprobs, advantage, scores.token_traj_index, advantage.shape[0]
    )  # (c,)
    return ComposerTerms(kl_tokens, delta, scores.action_logprobs.detach() - student_old.action_logprobs)


# ---- sums and the step's row ------------------------------------------------------------------------------


@dataclass
class StepSums:
    """What the chunks accumulate: each chunk's share of the batch's means (floats, reduced over ranks by
    `reduced`), token sums the row divides at the end, and per-trajectory sums for the diagnostics."""

    gap: Tensor  # (B,) Σ over τ's action tokens of log p_T,φ − log p_S,old
    kl: Tensor  # (B,) Σ over τ's action tokens of KL(p_S,old ‖ p_T,φ)
    shares: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("distill", "kl", "delta", "student_entropy", "teacher_entropy", "topk_mass"), 0.0
        )
    )
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("teacher", "student", "composer"), 0.0))

    @classmethod
    def zeros(cls, n_traj: int, device) -> StepSums:
        return cls(torch.zeros(n_traj, device=device), torch.zeros(n_traj, device=device))

    def add_teacher(self, scores: TeacherScores) -> None:
        self.shares["teacher_entropy"] += scores.entropy_sum
        self.shares["topk_mass"] += float(scores.topk_logprobs.exp().sum())

    def add_student_entropy(self, student_logprobs: Tensor) -> None:
        self.shares["student_entropy"] += float(-(student_logprobs.exp() * student_logprobs).sum())

    def add_composer(self, terms: ComposerTerms, token_rows: Tensor, kl_share: float, delta_share: float) -> None:
        """token_rows (n,): each token's trajectory in the batch."""
        self.shares["kl"] += kl_share
        self.shares["delta"] += delta_share
        self.gap.index_add_(0, token_rows, terms.gap)
        self.kl.index_add_(0, token_rows, terms.kl_tokens.detach())

    def reduced(self) -> dict[str, float]:
        """The shares summed over ranks: the whole batch's means (δ̄ included, so β is the same everywhere)."""
        return D.sum_dict(self.shares)

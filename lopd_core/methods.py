"""Baselines and ablations as settings of the one training loop (DESIGN §3 "Baselines and ablations").

A method is not a class or a copy of the loop: it is one row of `METHODS`, a `MethodSpec` of three small frozen
parts the trainer reads — `TeacherSetup` (what the teacher reads and with which weights), `StudentSetup` (the
student's loss) and `ComposerSetup` (whether φ learns, under which m and λ) — and a `role` the compare report
groups by, resolved once per run (`resolve_method`, in the distill driver). Every behaviour the loop needs is a
typed field of the spec (a `Literal`), never the method's name: the trainer, the configuration's rules and the
reports read fields, so adding a method is one row (tests/distill/test_methods.py adds one), plus at most one
text-context builder (baselines.py, `CONTEXT_BUILDERS`) when its teacher reads a new kind of text.
  * role — reference (LOPD as the paper specifies it), baseline (another published method), ablation (LOPD with
    one part removed or replaced, the ways past the teacher's ceiling included) or control (a run that tells a
    gain from experience apart from a gain from mere sharpening);
  * teacher.context — what the teacher reads in the first user turn (at the slot where LOPD splices latents):
      latent           composer latents from the retrieved experiences (LOPD)
      text_experience  the same retrieved experiences as plain text
      golden           the oracle's solution of this very task, as text (OPSD's privileged answer)
      sibling          a successful rollout of the same group, as text (SDPO); none in the group: no signal
      skill            a skill abstracted from the retrieved experiences: their tool sequence, no arguments
                       (Skill-SD abstracts with an LLM; a deterministic abstraction is what a tiny base allows)
      none             nothing (GRPO's reference, the sharpened-teacher control)
  * teacher.weights — frozen_base (θ̄, the policy at the start), student (the live student, no gradient) or
    ema (an exponential moving average of the student);
  * student.loss — reverse_kl (the distillation losses of `lopd.student_loss`), grpo (group-relative advantages,
    PPO-clip, plus `baselines.grpo_kl` · KL to the frozen base when > 0), grpo+kl (GRPO plus
    `baselines.skill_kl` · the sampled-token reverse KL toward the teacher: Skill-SD) or reverse_kl+grpo
    (`lopd_rl`, beyond the paper: LOPD's distillation loss plus `baselines.rl_weight` · the GRPO term on the
    same rollouts — distillation from experience leads early, the reward signal keeps climbing after the
    bank's coverage is exhausted). With `kl_mix` w > 0 the top-k distillation loss is (1 − w)·KL(p_S ‖ p_T) +
    w·KL(p_T ‖ p_S) (`lopd_forward_kl`: w = 1; `lopd_mixed_kl`: w = `lopd.kl_mix`, 0.5 when that is left at 0):
    reverse KL transfers skills more readily than facts, and a world's conventions are facts.

Past the teacher's ceiling (a distilled student stops at its teacher), three arms besides `lopd_rl`:
  * `then` — a second method the same student trains with after `baselines.switch_fraction` of lopd.steps
    (`lopd_then_grpo`: LOPD, then GRPO; "distillation before RL"). The phase is a function of the step
    (`phase_at`), so a checkpoint taken after the switch resumes in the second phase; the distill CSV's `phase`
    column is the index of the phase a row trained in (0 LOPD, 1 GRPO; a number, since every column of that CSV
    is logged as an MLflow metric), and GRPO without a reference KL runs no teacher pass, so the teacher's
    columns are empty from the switch on. The composer and β stand still in the GRPO phase;
  * `teacher.refresh` gated — the frozen teacher base θ̄ is replaced by the current student within the stage,
    only where a held-out greedy check shows the student ahead (`lopd_gated_refresh`; teacher_refresh.py; the
    CSV's `teacher_refreshes` counts them);
  * `student.kl_mix` — the forward-KL and mixed arms above. The composer's own KL(sg[p_S,old] ‖ p_T,φ) is unchanged.

The reward-led arms (DESIGN §3 "Reward-led arms"): the reward sets the direction, the teacher is a gated or
annealed per-token term. Each is a row: `lopd_rl_silent` (`lopd_rl` with the distillation term only on groups whose
rewards are all equal — where GRPO's advantage is 0 and the reward says nothing: HDPO / SRD), `lopd_rlsd` (RLSD: the
group-relative advantage gives each update's sign, the clipped teacher–student ratio (p_T/p_S)^sign(A) of the
sampled token its per-token size, `baselines.rlsd_clip`) and `lopd_rl_annealed` (`lopd_rl` whose distillation weight
is 1 − s_S/s_T, the student's recent success against the teacher's measured at the start: ATOD / RetireOPD).

Text contexts go through the same splice as latents: the embeddings of the text's ids placed in the latent slot
are exactly the conversation with that text in its first user turn (tests/distill/test_trainer.py checks this).

The two controls: `sharpened_teacher` (frozen base at `baselines.sharpen_temperature` < 1, no context) and
`lopd_random_retrieval` (random bank rows instead of the nearest) tell a gain from experience apart from a gain
from distilling toward any sharper distribution.

This module imports nothing of the library, so that the configuration can validate `lopd.method` against
`METHOD_NAMES` (and the method families below) without loading the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

TeacherContextKind = Literal["latent", "text_experience", "golden", "sibling", "skill", "none"]
TeacherWeights = Literal["frozen_base", "student", "ema"]
Retrieval = Literal["nearest", "random"]
Refresh = Literal["never", "gated"]
StudentLossFamily = Literal["reverse_kl", "grpo", "grpo+kl", "reverse_kl+grpo", "rlsd"]
DistillGate = Literal["all", "silent", "failed"]
Role = Literal["reference", "baseline", "ablation", "control"]
TEACHER_CONTEXTS: tuple[str, ...] = get_args(TeacherContextKind)
ROLES: tuple[str, ...] = get_args(Role)  # the order the compare report lists its groups in


@dataclass(frozen=True)
class TeacherSetup:
    """What the teacher reads in its latent slot, and with which weights."""

    context: TeacherContextKind
    weights: TeacherWeights = "frozen_base"  # frozen_base (θ̄) | student (live, no gradient) | ema
    temperature: float = 1.0  # the teacher's log-probs are those of softmax(logits / T)
    retrieval: Retrieval = "nearest"  # the bank rows a bank-reading teacher is given
    refresh: Refresh = "never"  # gated: θ̄ ← student where the held-out check shows the student ahead

    @property
    def uses_bank(self) -> bool:
        return self.context in ("latent", "text_experience", "skill")

    @property
    def reads_latents(self) -> bool:
        return self.context == "latent"

    @property
    def may_lack_context(self) -> bool:
        """Some trajectories may have no context (SDPO's groups without a success): those give no signal."""
        return self.context == "sibling"


@dataclass(frozen=True)
class StudentSetup:
    """The student's loss: which family, and its method-level weights."""

    loss: StudentLossFamily = "reverse_kl"
    reference_kl: float = 0.0  # GRPO: weight of the KL to the frozen base (baselines.grpo_kl)
    kl_mix: float = 0.0  # w of (1 − w)·reverse + w·forward KL when lopd.kl_mix is 0 (resolved: the run's w)
    # reverse_kl+grpo: which trajectories the distillation term reaches — all, those of groups whose rewards are
    # all equal (GRPO's advantage is 0 there: the reward is silent), or those of groups where every sample failed
    distill_gate: DistillGate = "all"
    anneal: bool = False  # reverse_kl+grpo: the distillation term fades as the student nears the teacher (anneal.py)

    @property
    def distills(self) -> bool:
        """Distils toward the teacher (lopd.student_loss applies), rather than a policy gradient alone."""
        return self.loss in ("reverse_kl", "reverse_kl+grpo")

    @property
    def adds_sampled_kl(self) -> bool:
        """GRPO plus the sampled-token reverse KL toward the teacher (Skill-SD)."""
        return self.loss == "grpo+kl"

    @property
    def adds_policy_gradient(self) -> bool:
        """A distillation loss plus the GRPO term on the same rollouts (`lopd_rl`)."""
        return self.loss == "reverse_kl+grpo"

    @property
    def weighs_distillation(self) -> bool:
        """The distillation term carries a per-trajectory weight: a gate on the group's rewards or the anneal."""
        return self.distill_gate != "all" or self.anneal


@dataclass(frozen=True)
class ComposerSetup:
    """Whether φ learns, and under which margin m and anchor weight λ (None: the lopd section's)."""

    trainable: bool = False  # φ learns (LOPD); False keeps φ = φ0 (or there is no composer)
    margin: float | None = None  # overrides lopd.margin; resolved, None: `lopd.margin: auto`, priced by the run
    anchor_weight: float | None = None  # overrides lopd.anchor_weight


@dataclass(frozen=True)
class MethodSpec:
    name: str
    role: Role
    teacher: TeacherSetup
    student: StudentSetup = field(default_factory=StudentSetup)
    composer: ComposerSetup = field(default_factory=ComposerSetup)
    then: str | None = None  # the method trained after baselines.switch_fraction of lopd.steps (one phase: None)
    # The `baselines` settings that set a field of this spec: (part, field, baselines key), applied by method_spec
    knobs: tuple[tuple[str, str, str], ...] = ()

    @property
    def uses_bank(self) -> bool:
        """Reads retrieved experiences: the bank's seed rollouts count against this method's budget."""
        return self.teacher.uses_bank

    @property
    def needs_composer(self) -> bool:
        return self.teacher.reads_latents

    @property
    def margin(self) -> float | None:
        """The m this method trains with (resolved: the method's own, else lopd.margin; None: priced by the run)."""
        return self.composer.margin

    @property
    def needs_teacher_pass(self) -> bool:
        """GRPO without a reference KL never runs a second model."""
        return self.student.loss != "grpo" or self.teacher.context != "none" or self.student.reference_kl > 0


_LOPD = ComposerSetup(trainable=True)
METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in [
        MethodSpec("lopd", "reference", TeacherSetup("latent"), composer=_LOPD),
        MethodSpec(
            "grpo",
            "baseline",
            TeacherSetup("none"),
            StudentSetup("grpo"),
            knobs=(("student", "reference_kl", "grpo_kl"),),
        ),
        MethodSpec("opsd", "baseline", TeacherSetup("golden")),
        MethodSpec(
            "sdpo", "baseline", TeacherSetup("sibling", weights="ema"), knobs=(("teacher", "weights", "sdpo_teacher"),)
        ),
        MethodSpec("skill_sd", "baseline", TeacherSetup("skill", weights="student"), StudentSetup("grpo+kl")),
        MethodSpec("text_experience", "baseline", TeacherSetup("text_experience")),
        MethodSpec("lopd_frozen_composer", "ablation", TeacherSetup("latent")),
        MethodSpec("lopd_no_margin", "ablation", TeacherSetup("latent"), composer=replace(_LOPD, margin=0.0)),
        MethodSpec("lopd_no_anchor", "ablation", TeacherSetup("latent"), composer=replace(_LOPD, anchor_weight=0.0)),
        MethodSpec(
            "sharpened_teacher",
            "control",
            TeacherSetup("none", temperature=0.5),
            knobs=(("teacher", "temperature", "sharpen_temperature"),),
        ),
        MethodSpec("lopd_random_retrieval", "control", TeacherSetup("latent", retrieval="random"), composer=_LOPD),
        MethodSpec("lopd_rl", "ablation", TeacherSetup("latent"), StudentSetup("reverse_kl+grpo"), _LOPD),
        MethodSpec("lopd_then_grpo", "ablation", TeacherSetup("latent"), composer=_LOPD, then="grpo"),
        MethodSpec("lopd_gated_refresh", "ablation", TeacherSetup("latent", refresh="gated"), composer=_LOPD),
        MethodSpec("lopd_forward_kl", "ablation", TeacherSetup("latent"), StudentSetup(kl_mix=1.0), _LOPD),
        MethodSpec("lopd_mixed_kl", "ablation", TeacherSetup("latent"), StudentSetup(kl_mix=0.5), _LOPD),
        MethodSpec(
            "lopd_rl_silent",
            "ablation",
            TeacherSetup("latent"),
            StudentSetup("reverse_kl+grpo", distill_gate="silent"),
            _LOPD,
        ),
        MethodSpec("lopd_rlsd", "ablation", TeacherSetup("latent"), StudentSetup("rlsd"), _LOPD),
        MethodSpec(
            "lopd_rl_annealed", "ablation", TeacherSetup("latent"), StudentSetup("reverse_kl+grpo", anneal=True), _LOPD
        ),
    ]
}
METHOD_NAMES = tuple(METHODS)  # the order is the order reports list them in
# The families the configuration's cross-key rules name (lopd.importance_weight, lopd.kl_mix, lopd.student_loss)
POLICY_GRADIENT_METHODS = tuple(n for n, s in METHODS.items() if not s.student.distills)
SAMPLED_KL_METHODS = tuple(n for n, s in METHODS.items() if s.student.adds_sampled_kl)
KL_MIX_METHODS = tuple(n for n, s in METHODS.items() if s.student.kl_mix > 0)
FORWARD_KL_METHODS = tuple(n for n, s in METHODS.items() if s.student.kl_mix == 1.0)


def method_spec(name: str, baselines=None) -> MethodSpec:
    """The spec of `name`, with the knobs of the `baselines` params section applied (its `knobs`: SDPO's teacher
    weights, the sharpened teacher's temperature, GRPO's reference KL)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHOD_NAMES)}")
    spec = METHODS[name]
    for part, field_name, knob in spec.knobs if baselines is not None else ():
        spec = replace(spec, **{part: replace(getattr(spec, part), **{field_name: getattr(baselines, knob)})})
    return spec


def resolve_method(lopd, baselines) -> MethodSpec:
    """The method a run trains, every setting resolved: `lopd.method`'s spec with the `baselines` knobs, and
    its margin and anchor weight as numbers (the method's own where it overrides them, else `lopd.margin` and
    `lopd.anchor_weight`). The trainer keeps this on the distiller and the reports read the margin from it, so
    a dashboard draws the m a run trained with (0 for `lopd_no_margin`), not the section's. With
    `lopd.margin: auto` (and no margin of the method's own) the margin is None: the run prices it at its start
    (margin.py), and the reports read the m it used from the CSV's `margin` column."""
    spec = method_spec(lopd.method, baselines)
    student = replace(spec.student, kl_mix=kl_mix_of(spec, lopd))  # the run's w: lopd.kl_mix where set
    own = None if isinstance(lopd.margin, str) else float(lopd.margin)  # a string is `auto` (the config checks)
    c = spec.composer
    composer = replace(
        c,
        margin=own if c.margin is None else c.margin,
        anchor_weight=lopd.anchor_weight if c.anchor_weight is None else c.anchor_weight,
    )
    return replace(spec, student=student, composer=composer)


def kl_mix_of(spec: MethodSpec, lopd) -> float:
    """The w of a distilling method's top-k loss (1 − w)·reverse + w·forward: `lopd.kl_mix` where it is set
    (> 0), else the method's own (`lopd_mixed_kl` 0.5, `lopd_forward_kl` 1, the others 0: pure reverse KL). A
    policy-gradient method has none (the config refuses lopd.kl_mix > 0 with one)."""
    if not spec.student.distills:
        return 0.0
    return float(lopd.kl_mix) if lopd.kl_mix > 0 else spec.student.kl_mix


def switch_step(spec: MethodSpec, lopd, baselines) -> int | None:
    """The first step (0-based) trained as `spec.then`: `baselines.switch_fraction` of lopd.steps, rounded half
    up (not Python's round-half-even: one step at 0.5 is a LOPD step); None for a one-phase method. Counted on
    lopd.steps, the run's budget, not on how far one call of the loop goes (`lopd compare` trains to its curve
    points one call at a time)."""
    if spec.then is None:
        return None
    return math.floor(baselines.switch_fraction * lopd.steps + 0.5)


def method_phases(first: MethodSpec, lopd, baselines) -> tuple[MethodSpec, ...]:
    """The specs a run trains in turn: `first` (resolved) alone, or `first` then its `then` method with the
    `baselines` knobs (its margin and anchor weight carried over, so the reports read one m for the run)."""
    if first.then is None:
        return (first,)
    second = method_spec(first.then, baselines)
    second = replace(
        second,
        composer=replace(second.composer, margin=first.composer.margin, anchor_weight=first.composer.anchor_weight),
    )
    return first, second


def phase_at(spec: MethodSpec, step: int, lopd, baselines) -> int:
    """Which phase (0, 1) of `method_phases` trains step `step` (0-based, the steps completed before it): a
    function of the step alone, so a run resumed past the switch trains where the uninterrupted run would."""
    switch = switch_step(spec, lopd, baselines)
    return 0 if switch is None or step < switch else 1

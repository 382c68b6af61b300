"""Baselines and ablations as settings of the one training loop (DESIGN §3 "Baselines and ablations").

A method is not a class or a copy of the loop: it is a `MethodSpec` that says three things the trainer reads
where it builds the teacher's input and picks the student's loss —
  * teacher_context — what the teacher reads in the first user turn (at the slot where LOPD splices latents):
      latent           composer latents from the retrieved experiences (LOPD)
      text_experience  the same retrieved experiences as plain text
      golden           the oracle's solution of this very task, as text (OPSD's privileged answer)
      sibling          a successful rollout of the same group, as text (SDPO); none in the group: no signal
      skill            a skill abstracted from the retrieved experiences: their tool sequence, no arguments
                       (Skill-SD abstracts with an LLM; a deterministic abstraction is what a tiny base allows)
      none             nothing (GRPO's reference, the sharpened-teacher control)
  * teacher_weights — frozen_base (θ̄, the policy at the start), student (the live student, no gradient) or
    ema (an exponential moving average of the student);
  * loss — reverse_kl (the distillation losses of `lopd.student_loss`), grpo (group-relative advantages,
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
  * `teacher_refresh` gated — the frozen teacher base θ̄ is replaced by the current student within the stage,
    only where a held-out greedy check shows the student ahead (`lopd_gated_refresh`; teacher_refresh.py; the
    CSV's `teacher_refreshes` counts them);
  * `kl_mix` — the forward-KL and mixed arms above. The composer's own KL(sg[p_S,old] ‖ p_T,φ) is unchanged.

Text contexts go through the same splice as latents: the embeddings of the text's ids placed in the latent slot
are exactly the conversation with that text in its first user turn (tests/lopd/test_trainer.py checks this).

The two controls: `sharpened_teacher` (frozen base at `baselines.sharpen_temperature` < 1, no context) and
`lopd_random_retrieval` (random bank rows instead of the nearest) tell a gain from experience apart from a gain
from distilling toward any sharper distribution.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, replace

from lopd_core.config import MARGIN_AUTO
from lopd_core.envs import Task, run_oracle
from lopd_core.experience import format_experience

TEACHER_CONTEXTS = ("latent", "text_experience", "golden", "sibling", "skill", "none")
TEACHER_WEIGHTS = ("frozen_base", "student", "ema")
LOSSES = ("reverse_kl", "grpo", "grpo+kl", "reverse_kl+grpo")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    teacher_context: str
    teacher_weights: str = "frozen_base"
    loss: str = "reverse_kl"
    composer_trainable: bool = False  # φ learns (LOPD); False keeps φ = φ0 (or there is no composer)
    margin: float | None = None  # overrides lopd.margin; resolved, None: `lopd.margin: auto`, priced by the run
    anchor_weight: float | None = None  # overrides lopd.anchor_weight
    retrieval: str = "nearest"  # nearest | random
    teacher_temperature: float = 1.0  # the teacher's log-probs are those of softmax(logits / T)
    reference_kl: float = 0.0  # GRPO: weight of the KL to the frozen base (baselines.grpo_kl)
    kl_mix: float = 0.0  # w of (1 − w)·reverse + w·forward KL when lopd.kl_mix is 0 (resolved: the run's w)
    then: str | None = None  # the method trained after baselines.switch_fraction of lopd.steps (one phase: None)
    teacher_refresh: str = "never"  # never | gated: θ̄ ← student where the held-out check shows the student ahead

    @property
    def uses_bank(self) -> bool:
        """Reads retrieved experiences: the bank's seed rollouts count against this method's budget."""
        return self.teacher_context in ("latent", "text_experience", "skill")

    @property
    def needs_composer(self) -> bool:
        return self.teacher_context == "latent"

    @property
    def is_lopd_variant(self) -> bool:
        return self.needs_composer

    @property
    def needs_teacher_pass(self) -> bool:
        """GRPO without a reference KL never runs a second model."""
        return self.loss != "grpo" or self.teacher_context != "none" or self.reference_kl > 0


METHODS: dict[str, MethodSpec] = {s.name: s for s in [
    MethodSpec("lopd", "latent", composer_trainable=True),
    MethodSpec("grpo", "none", loss="grpo"),
    MethodSpec("opsd", "golden"),
    MethodSpec("sdpo", "sibling", teacher_weights="ema"),
    MethodSpec("skill_sd", "skill", teacher_weights="student", loss="grpo+kl"),
    MethodSpec("text_experience", "text_experience"),
    MethodSpec("lopd_frozen_composer", "latent", composer_trainable=False),
    MethodSpec("lopd_no_margin", "latent", composer_trainable=True, margin=0.0),
    MethodSpec("lopd_no_anchor", "latent", composer_trainable=True, anchor_weight=0.0),
    MethodSpec("sharpened_teacher", "none", teacher_temperature=0.5),
    MethodSpec("lopd_random_retrieval", "latent", composer_trainable=True, retrieval="random"),
    MethodSpec("lopd_rl", "latent", composer_trainable=True, loss="reverse_kl+grpo"),
    MethodSpec("lopd_then_grpo", "latent", composer_trainable=True, then="grpo"),
    MethodSpec("lopd_gated_refresh", "latent", composer_trainable=True, teacher_refresh="gated"),
    MethodSpec("lopd_forward_kl", "latent", composer_trainable=True, kl_mix=1.0),
    MethodSpec("lopd_mixed_kl", "latent", composer_trainable=True, kl_mix=0.5),
]}
METHOD_NAMES = tuple(METHODS)


def method_spec(name: str, baselines=None) -> MethodSpec:
    """The spec of `name`, with the knobs of the `baselines` params section applied (SDPO's teacher weights,
    the sharpened teacher's temperature, GRPO's reference KL)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHOD_NAMES)}")
    spec = METHODS[name]
    if baselines is not None:
        if name == "sdpo":
            spec = replace(spec, teacher_weights=baselines.sdpo_teacher)
        if name == "sharpened_teacher":
            spec = replace(spec, teacher_temperature=baselines.sharpen_temperature)
        if name == "grpo":
            spec = replace(spec, reference_kl=baselines.grpo_kl)
    return spec


def resolve_method(lopd, baselines) -> MethodSpec:
    """The method a run trains, every setting resolved: `lopd.method`'s spec with the `baselines` knobs, and
    its margin and anchor weight as numbers (the method's own where it overrides them, else `lopd.margin` and
    `lopd.anchor_weight`). The trainer keeps this on the distiller and the reports read the margin from it, so
    a dashboard draws the m a run trained with (0 for `lopd_no_margin`), not the section's. With
    `lopd.margin: auto` (and no margin of the method's own) the margin is None: the run prices it at its start
    (margin.py), and the reports read the m it used from the CSV's `margin` column."""
    spec = method_spec(lopd.method, baselines)
    spec = replace(spec, kl_mix=kl_mix_of(spec, lopd))  # the run's w: lopd.kl_mix where set, else the method's
    own = None if lopd.margin == MARGIN_AUTO else float(lopd.margin)
    return replace(spec, margin=own if spec.margin is None else spec.margin,
                   anchor_weight=lopd.anchor_weight if spec.anchor_weight is None else spec.anchor_weight)


def kl_mix_of(spec: MethodSpec, lopd) -> float:
    """The w of a distilling method's top-k loss (1 − w)·reverse + w·forward: `lopd.kl_mix` where it is set
    (> 0), else the method's own (`lopd_mixed_kl` 0.5, `lopd_forward_kl` 1, the others 0: pure reverse KL). A
    policy-gradient method has none (the config refuses lopd.kl_mix > 0 with one)."""
    if spec.loss not in ("reverse_kl", "reverse_kl+grpo"):
        return 0.0
    return float(lopd.kl_mix) if lopd.kl_mix > 0 else spec.kl_mix


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
    second = replace(method_spec(first.then, baselines), margin=first.margin, anchor_weight=first.anchor_weight)
    return first, second


def phase_at(spec: MethodSpec, step: int, lopd, baselines) -> int:
    """Which phase (0, 1) of `method_phases` trains step `step` (0-based, the steps completed before it): a
    function of the step alone, so a run resumed past the switch trains where the uninterrupted run would."""
    switch = switch_step(spec, lopd, baselines)
    return 0 if switch is None or step < switch else 1


# ---- text contexts -----------------------------------------------------------------------------------------

_GOLDEN: dict[str, str] = {}


def golden_text(task: Task) -> str:
    """The oracle's solution of `task` as an experience text (cached: the oracle is deterministic per task)."""
    key = task.to_json()
    if key not in _GOLDEN:
        _, _, env = run_oracle(task)
        _GOLDEN[key] = format_experience(task.instruction, env.episode)
    return _GOLDEN[key]


def sibling_texts(trajs: list, group_size: int) -> list[str | None]:
    """Per trajectory, a successful sibling of its group as text: the first other success of the group, else
    its own when it is the group's only success; None when the group has none (SDPO: no signal)."""
    out: list[str | None] = []
    for i, t in enumerate(trajs):
        g = i // group_size
        group = range(g * group_size, min((g + 1) * group_size, len(trajs)))
        wins = [j for j in group if trajs[j].success]
        pick = next((j for j in wins if j != i), wins[0] if wins else None)
        out.append(None if pick is None else format_experience(trajs[pick].task.instruction,
                                                               trajs[pick].episode))
    return out


def skill_text(experiences: list[str]) -> str:
    """A skill abstracted from experience texts: the distinct tool sequences they used, arguments and results
    dropped (what transfers across instances of a world), plus the rule of ending with an answer."""
    chains = []
    for text in experiences:
        tools = [line.split(" ", 1)[0] for line in text.split("\n")[1:] if line and not line.startswith("answer:")]
        chain = " -> ".join(tools)
        if chain and chain not in chains:
            chains.append(chain)
    if not chains:
        return ""
    return "skill: " + " | ".join(chains) + " -> answer"


def random_retriever(bank_texts: list[str], j: int, seed: int):
    """The `lopd_random_retrieval` control: J bank rows drawn at random per task, the same rows for the same
    task and seed (so a resumed run reads the same latents)."""
    texts = list(bank_texts)

    def retrieve(tasks: list[Task]) -> list[list[str]]:
        out = []
        for t in tasks:
            digest = hashlib.sha1(f"{seed}:{t.task_id}".encode()).hexdigest()
            rng = random.Random(int(digest[:12], 16))
            out.append(rng.sample(texts, min(j, len(texts))))
        return out

    return retrieve


def text_contexts(spec: MethodSpec, tasks: list[Task], trajs: list, per_task: list[list[str]],
                  group_size: int) -> list[str | None] | None:
    """What the teacher reads as text, per trajectory (None: no signal for that trajectory); None for the
    methods whose teacher reads latents or nothing."""
    kind = spec.teacher_context
    if kind in ("latent", "none"):
        return None
    if kind == "sibling":
        return sibling_texts(trajs, group_size)
    out: list[str | None] = []
    for i in range(len(trajs)):
        g = i // group_size
        if kind == "text_experience":
            out.append("\n".join(per_task[g]))  # joined as the chat format joins experiences
        elif kind == "golden":
            out.append(golden_text(tasks[g]))
        else:  # skill
            out.append(skill_text(per_task[g]))
    return out


def ema_copy(model):
    """A frozen copy of the student that `update_ema` keeps as an exponential moving average."""
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


def update_ema(ema, model, decay: float) -> None:
    """θ_ema ← decay·θ_ema + (1 − decay)·θ, parameter by parameter (the copies share their layout)."""
    import torch

    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p.detach().to(e.dtype), 1.0 - decay)

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
    bank's coverage is exhausted).
Text contexts go through the same splice as latents: the embeddings of the text's ids placed in the latent slot
are exactly the conversation with that text in its first user turn (tests/lopd/test_trainer.py checks this).

The two controls: `sharpened_teacher` (frozen base at `baselines.sharpen_temperature` < 1, no context) and
`lopd_random_retrieval` (random bank rows instead of the nearest) tell a gain from experience apart from a gain
from distilling toward any sharper distribution.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace

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
    margin: float | None = None  # overrides lopd.margin
    anchor_weight: float | None = None  # overrides lopd.anchor_weight
    retrieval: str = "nearest"  # nearest | random
    teacher_temperature: float = 1.0  # the teacher's log-probs are those of softmax(logits / T)
    reference_kl: float = 0.0  # GRPO: weight of the KL to the frozen base (baselines.grpo_kl)

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
    a dashboard draws the m a run trained with (0 for `lopd_no_margin`), not the section's."""
    spec = method_spec(lopd.method, baselines)
    return replace(spec, margin=lopd.margin if spec.margin is None else spec.margin,
                   anchor_weight=lopd.anchor_weight if spec.anchor_weight is None else spec.anchor_weight)


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

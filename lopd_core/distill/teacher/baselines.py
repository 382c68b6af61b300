"""What the baselines' teachers read instead of latents, and the EMA teacher (methods.py says which method reads
what).

A text context is built per trajectory by the builder of its method's `teacher.context` (`CONTEXT_BUILDERS`,
one per kind of text; "latent" and "none" read no text) and spliced into the latent slot, where it is exactly
the conversation with that text in its first user turn (update/parts.py `context_embeddings`).
"""

from __future__ import annotations

import copy
import hashlib
import random
from collections.abc import Callable

import torch

from lopd_core.distill.composer.lru import LRUCache
from lopd_core.envs import Task, run_oracle
from lopd_core.experience import format_experience
from lopd_core.methods import MethodSpec

# (tasks, trajectories, retrieved texts per task, samples per task) -> the text per trajectory (None: no signal)
ContextBuilder = Callable[[list[Task], list, list[list[str]], int], list[str | None]]

# the oracle's texts by task (the oracle is deterministic per task), bounded: a run streams new tasks for as long
# as it lasts (lru.py)
_GOLDEN: LRUCache[str, str] = LRUCache()


def golden_text(task: Task) -> str:
    """The oracle's solution of `task` as an experience text (cached: the oracle is deterministic per task)."""
    key = task.to_json()
    text = _GOLDEN.get(key)
    if text is None:
        _, _, env = run_oracle(task)
        text = format_experience(task.instruction, env.episode)
        _GOLDEN.put(key, text)
    return text


def sibling_texts(trajs: list, group_size: int) -> list[str | None]:
    """Per trajectory, a successful sibling of its group as text: the first other success of the group, else
    its own when it is the group's only success; None when the group has none (SDPO: no signal)."""
    out: list[str | None] = []
    for i in range(len(trajs)):
        g = i // group_size
        group = range(g * group_size, min((g + 1) * group_size, len(trajs)))
        wins = [j for j in group if trajs[j].success]
        pick = next((j for j in wins if j != i), wins[0] if wins else None)
        out.append(None if pick is None else format_experience(trajs[pick].task.instruction, trajs[pick].episode))
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


CONTEXT_BUILDERS: dict[str, ContextBuilder] = {
    # the retrieved experiences, joined as the chat format joins them
    "text_experience": lambda tasks, trajs, per_task, g: ["\n".join(per_task[i // g]) for i in range(len(trajs))],
    "golden": lambda tasks, trajs, per_task, g: [golden_text(tasks[i // g]) for i in range(len(trajs))],
    "sibling": lambda tasks, trajs, per_task, g: sibling_texts(trajs, g),
    "skill": lambda tasks, trajs, per_task, g: [skill_text(per_task[i // g]) for i in range(len(trajs))],
}


def text_contexts(
    spec: MethodSpec, tasks: list[Task], trajs: list, per_task: list[list[str]], group_size: int
) -> list[str | None] | None:
    """What the teacher reads as text, per trajectory (None: no signal for that trajectory); None for the
    methods whose teacher reads latents or nothing."""
    build = CONTEXT_BUILDERS.get(spec.teacher.context)
    return None if build is None else build(tasks, trajs, per_task, group_size)


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


def ema_copy(model):
    """A frozen copy of the student that `update_ema` keeps as an exponential moving average."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def update_ema(ema, model, decay: float) -> None:
    """θ_ema ← decay·θ_ema + (1 − decay)·θ, parameter by parameter (the copies share their layout)."""
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p.detach().to(e.dtype), 1.0 - decay)

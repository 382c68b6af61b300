"""φ fitted where it serves: the composer read into the deployment world before distillation.

φ0 is fitted on the pretraining worlds (coldstart.py) and does not transfer to a new world: there its latents carry
a fraction of what the same rows carry as text (DESIGN §3). This fits φ, starting from φ0 (or from the champion's
φ in a later cycle), so that the frozen base reading φ's latents of the retrieved bank rows matches the same base
reading those rows as plain text:

    loss_φ = KL(p_text ‖ p_latent)   at the action positions of trajectories sampled in the deployment world,

context distillation toward the text-conditioned teacher on self-generated queries. No oracle: the targets are
the bank stage's own seed rollouts (already sampled, so free; successes and failures alike, since their tokens
are read, never imitated: no NLL) and, with `coldstart.online_rollouts` > 0, fresh rollouts of the text teacher on
training tasks (charged as rollouts). Retrieval is as in training — same world — but never the target task's own
rows: the bank holds these very successes, and reading one's own back would teach copying, not reading.

The step itself is the cold start's (`train_coldstart` with `nll_weight` 0); what is new here is the data.
"""

from __future__ import annotations

from collections.abc import Callable

from lopd_core.distill.composer.coldstart_data import ORACLE_SAMPLE_INDEX, Success
from lopd_core.distill.scoring.teacher import Framing
from lopd_core.envs import Task
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

FIT_SEED_OFFSET = 303  # the text teacher's fresh training tasks: a stream apart from the bank's seed tasks


def seed_targets(table) -> list[Success]:
    """Every policy sample of a bank's seed table (never an oracle row), as a fit target."""
    rows = table[table["sample_index"] != ORACLE_SAMPLE_INDEX]
    return [
        Success([int(i) for i in r.token_ids], [int(m) for m in r.action_mask], Task.from_json(r.task))
        for r in rows.itertuples(index=False)
    ]


def strip_experience_block(ids: list[int], mask: list[int], framing: Framing) -> tuple[list[int], list[int]]:
    """The student's view of a text teacher's trajectory: its `<|exp_start|>…<|exp_end|>\\n` block cut out of the
    first user turn (where the latent slot sits), the rest of the ids unchanged. Ids without a block are returned
    as they are."""
    if framing.exp_start not in ids:
        return list(ids), list(mask)
    start = ids.index(framing.exp_start)
    end = ids.index(framing.exp_end, start)
    stop = end + 2 if end + 1 < len(ids) and ids[end + 1] == framing.newline else end + 1
    if any(mask[start:stop]):
        raise ValueError("an experience block holds sampled tokens: the ids are not a text teacher's trajectory")
    return ids[:start] + ids[stop:], mask[:start] + mask[stop:]


def text_teacher_targets(
    model,
    tokenizer,
    tasks: list[Task],
    texts: list[list[str]],
    *,
    sampling: Sampling,
    batch_size: int,
    seed: int,
    log=print,
) -> list[Success]:
    """Rollouts of the text teacher (the frozen base reading each task's retrieved rows as text), as fit targets
    in the student's view (the block cut out). Tasks that retrieved nothing are skipped: they teach φ nothing."""
    from lopd_core.model.chat import make_chat

    requests = [RolloutRequest(t, experiences=tuple(x)) for t, x in zip(tasks, texts) if x]
    trajs = rollout(
        model,
        make_chat(tokenizer),
        requests,
        sampling=sampling,
        batch_size=batch_size,
        seed=seed,
        progress=lambda done, total: log(f"fit: {done}/{total} text-teacher rollouts") if done == total else None,
    )
    framing = Framing.from_tokenizer(tokenizer)
    out = []
    for t in trajs:
        ids, mask = strip_experience_block(list(t.token_ids), list(t.action_mask), framing)
        out.append(Success(ids, mask, t.task))
    return out


def cached_retriever(
    retrieve: Callable[[list[Task]], list[list[str]]], targets: list[Success]
) -> tuple[Callable[[list[Task]], list[list[str]]], list[Success]]:
    """Retrieve once per target task (the bank does not change during a fit) and keep only the targets that read
    something: a task with no same-world row gives both readings the plain base, and no gradient to φ."""
    unique = list({t.task.task_id: t.task for t in targets}.values())
    found = dict(zip((t.task_id for t in unique), retrieve(unique))) if unique else {}
    kept = [t for t in targets if found.get(t.task.task_id)]

    def lookup(tasks: list[Task]) -> list[list[str]]:
        return [found[t.task_id] for t in tasks]

    return lookup, kept

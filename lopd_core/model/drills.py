"""Copy and lookup drills: short procedural conversations that teach the tiny base to read its context.

A warm start on demonstrations alone leaves the embedded base unable to copy: it mostly predicts the most
frequent value (a name, a product, a month) where the instruction holds the argument to copy
(docs/experiments/2026-12-05-base-design-figures.md). A pretrained LLM brings that skill; the tiny base must get it from
somewhere. The drills isolate it, in the same chat framing the tasks use:

* **copy** — the user turn holds a few environment words; the answer repeats them in order;
* **lookup** — the user turn holds records shaped like tool observations (`{"id": "a43", "label": "savings"}`)
  and asks for one field of the record another field names; the answer is that field's value, both ways round.

They are mixed into the warm start with the demonstrations cut after their first action (short sequences whose
target mostly copies from the instruction). Run first as a block, the drills were forgotten; mixed in, with an
auxiliary loss on the context tokens and small batches, they raised both copying from the instruction and
token accuracy at the same time budget (`probes/warmstart_probe.py` measures it). Words come from the
demonstrations themselves, so the drills add no new vocabulary.
"""

from __future__ import annotations

import random
import re

from lopd_core.model.chat import ChatCodec, TrajectoryIds

_WORD = re.compile(r"[A-Za-z][A-Za-z_]*|\d+")
_FIELDS = ("label", "name", "owner", "title", "item", "city")


def drill_vocabulary(texts, limit: int = 4000) -> tuple[list[str], list[str]]:
    """Words and numbers seen in `texts` (capped), for the drills to draw from."""
    words, numbers = set(), set()
    for text in texts:
        for token in _WORD.findall(text):
            (numbers if token.isdigit() else words).add(token)
        if len(words) >= limit:
            break
    return sorted(words), sorted(numbers)


def _copy_drill(words: list[str], rng: random.Random) -> tuple[str, str, str]:
    picked = [rng.choice(words) for _ in range(rng.randint(1, 3))]
    return "copy", " ".join(picked), " ".join(picked)


def _lookup_drill(words: list[str], numbers: list[str], rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(2, 5)
    field = rng.choice(_FIELDS)
    values = rng.sample(words, n)
    ids = [f"{rng.choice('aefmpst')}{rng.choice(numbers)}" for _ in range(n)]
    # The field before the id, as the environments' observations list records (`{"label": "savings", "id":
    # "a8"}`): "id of savings" then reads forward from the matched value, the lookup every payment needs.
    records = ", ".join(f'{{"{field}": "{v}", "id": "{i}"}}' for i, v in zip(ids, values))
    k = rng.randrange(n)
    if rng.random() < 0.5:
        return "lookup", f'{{"result": [{records}]}}\nid of {values[k]}?', ids[k]
    return "lookup", f'{{"result": [{records}]}}\n{field} of {ids[k]}?', values[k]


def build_drills(texts, n: int, seed: int) -> list[tuple[str, str, str]]:
    """`n` drills as (system, user, answer) texts; half copy, half lookup."""
    rng = random.Random(seed)
    words, numbers = drill_vocabulary(texts)
    if not words or not numbers:
        return []
    return [_copy_drill(words, rng) if rng.random() < 0.5 else _lookup_drill(words, numbers, rng) for _ in range(n)]


def encode_drill(drill: tuple[str, str, str], codec: ChatCodec) -> TrajectoryIds:
    system, user, answer = drill
    traj = codec.start(system, user)
    traj.add_action(codec.action_ids(answer))
    return traj

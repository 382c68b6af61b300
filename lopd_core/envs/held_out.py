"""Which split an instance's content belongs to: the partition the built-in environments draw their splits by.

An instance's content key (a 64-bit hash of what the task is: for toolworld its template, world, instruction,
state, checks and answer; for codegen its family, level and tests) sends it to exactly one part:

  * key % 8 == 0: the tests, test_id in the deployment worlds and pretrain_test in the pretraining worlds (the
    rule these splits always had: their tasks are the ones every earlier figure was measured on);
  * otherwise `train`, except in a deployment task set, where the key's high half h = (key >> 32) % 32 carves two
    parts out of train's: h == 0 `val`, h == 1 `test_final`.

A split keeps drawing (seeded attempts of its own stream) until an instance falls in its part, so within a
deployment task set no task of one part can equal a task of another, whatever the seeds and sizes: train, val,
test_id and test_final are disjoint by content (tests/envs/test_held_out.py). test_ood needs no part: it plays
held-out templates no other split has.

Carved only where val and test_final are drawn: the deployment task sets. A toolworld instance is carved when its
world is a named world (the deployment candidates, NAMED_WORLDS; generated pretraining worlds never take their
names). codegen has no worlds, so its task set follows the stream it is drawn for: carved unless it is drawn for
the pretraining worlds only (the warm start's demonstrations and the cold start's stream pass them). Why: the
pretraining stream's train tasks are the shipped base's warm-start data, so they stay exactly the tasks they were
(same instances, same order) and `lopd base` still rebuilds the shipped base; a deployment train set gives up 2
of 32 of its content, so about 6 % of its instances are drawn again, from the same templates and worlds. val and
test_final asked of a pretraining task set are refused: there they would not be disjoint from its train.

What each is for:
  * `val`: held-out tasks of the training distribution (deployment worlds, training templates) on which design
    choices are made, such as the composer's options (probes/teacher_probe.py reads it by default);
  * `test_final`: the same distribution, read by no decision and no design choice: `lopd evaluate` and the cycle's
    report show it, and the gate, its guards and every option choice refuse it (lopd_core/settings/run.py).

Why carved out of train's part, not test_id's: test_id's tasks stay exactly what they were, so paired comparisons
with earlier runs (`compare.reuse`) and the published base figures still hold.
"""

from __future__ import annotations

from lopd_core.settings.envs import NAMED_WORLDS

TEST_BUCKETS = 8  # 1 in 8 instances' content is a test's (test_id / pretrain_test)
CARVE = 32  # of the rest, in a deployment task set, 1 in 32 is val's and 1 in 32 test_final's
# The most attempts a split makes for one instance: val and test_final accept 7 in 256 draws (about 37 expected),
# so 4000 attempts fail with probability (249/256)^4000 < 1e-48.
MAX_ATTEMPTS = 4000
CARVED_SPLITS = ("val", "test_final")  # drawn in the deployment task sets only

PART_OF_SPLIT = {
    "train": "train",
    "val": "val",
    "test_id": "test",
    "pretrain_test": "test",
    "test_final": "test_final",
}


def content_part(key: int, carved: bool = True) -> str:
    """The part (train | val | test | test_final) an instance whose content key is `key` belongs to; `carved`:
    whether it is drawn for a deployment task set (else val and test_final are train's, as before they existed)."""
    if key % TEST_BUCKETS == 0:
        return "test"
    if not carved:
        return "train"
    high = (key >> 32) % CARVE
    return {0: "val", 1: "test_final"}.get(high, "train")


def takes(split: str, key: int, carved: bool = True) -> bool:
    """Whether `split` may hold an instance of content key `key` (test_ood takes any: its templates are its own)."""
    part = PART_OF_SPLIT.get(split)
    return part is None or content_part(key, carved) == part


def is_deployment_world(world: str) -> bool:
    """A named world (a deployment candidate): its instances are carved."""
    return world in NAMED_WORLDS


def is_deployment_set(worlds) -> bool:
    """Whether a task set drawn for `worlds` (names; None: the named worlds, toolworld's default) is a deployment
    one: codegen's rule, which has no worlds of its own to tell."""
    return worlds is None or any(is_deployment_world(w) for w in worlds)


def refuse_pretraining(split: str, env: str) -> None:
    """val and test_final exist in the deployment task sets only (module docstring): a ValueError otherwise."""
    if split in CARVED_SPLITS:
        raise ValueError(
            f"{env}: {split!r} is drawn in the deployment worlds only (named worlds: {', '.join(NAMED_WORLDS)}); "
            "in the pretraining worlds its content is train's"
        )

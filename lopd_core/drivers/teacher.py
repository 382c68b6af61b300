"""The teacher stage's driver: the teacher in play (lopd_core/distill/teacher/teacher_play.py) — the frozen base at
`model.name_or_path` alone, reading its bank rows (`bank.dir`) as text, and as a composer's latents — on the
evaluation's held-out tasks of `eval.teacher_splits`. `lopd evaluate --teacher-in-play` and every cycle call it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lopd_core.bank import read_bank
from lopd_core.config import Params
from lopd_core.distill.teacher.teacher_play import teacher_in_play
from lopd_core.drivers.bank import bank_paths, make_retriever, open_bank
from lopd_core.drivers.coldstart import load_phi
from lopd_core.drivers.distill import starting_composer
from lopd_core.model.loading import load_policy


def check_teacher_inputs(params: Params, composer: str | None = None) -> str:
    """The composer the teacher reads (None: the one distillation starts from); a missing composer or bank is one
    line naming the stage to run, checked before any work (`lopd evaluate --teacher-in-play` calls it first)."""
    composer = composer or starting_composer(params)
    if not Path(composer).exists():
        raise FileNotFoundError(f"teacher in play: no composer at {composer} (run `lopd coldstart` and `lopd fit`)")
    parquet, seed_path = bank_paths(params)
    if not seed_path.exists():  # the bank stage never ran here (an empty bank still leaves its seed rollouts)
        raise FileNotFoundError(f"teacher in play: no bank at {parquet.parent} (run `lopd bank`)")
    return composer


def run_teacher_in_play(params: Params, *, composer: str | None = None, model=None, tokenizer=None, log=print) -> dict:
    """{env: {split: {"teacher_in_play": ...}}} for the policy at model.name_or_path (or `model` and `tokenizer`
    already loaded), reading the bank at bank.dir through `composer` (None: the composer distillation starts from,
    drivers/distill.py `starting_composer`). {} when eval.teacher_splits is empty."""
    splits = [s for s in params.eval.teacher_splits if s in params.eval.splits]
    if not splits:
        return {}
    composer = check_teacher_inputs(params, composer)
    if read_bank(bank_paths(params)[0]).empty:
        log("teacher in play: the bank holds no success yet, so the teacher reads nothing: not played")
        return {}
    if model is None:
        model, tokenizer = load_policy(params.model)
    model.eval()
    phi = load_phi(params, model, composer)
    others = dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False)
    with open_bank(params) as bank:
        return teacher_in_play(model, tokenizer, params, phi, make_retriever(bank, others), splits=splits, log=log)

"""The distill stage's driver (`run_lopd`) and the retrieval rules it shares with the tools around it.

`run_lopd` reads its inputs from the paths in params and writes its outputs there; `lopd distill`, the cycle's
distill task and `lopd compare` call it and nothing deeper. The other stages' drivers are in lopd_core/drivers/
(the bank's and the cold start's names are re-exported here for the callers that import them from this module).
  lopd.out_dir/checkpoint.pt        resumable training state       lopd.out_dir/student/            the student
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path

from lopd_core import distributed as D
from lopd_core import methods as M
from lopd_core.bank import ExperienceBank
from lopd_core.config import Params
from lopd_core.distill.composer.coldstart_data import ORACLE_SAMPLE_INDEX
from lopd_core.distill.loop.build import check_top_k, load_composer
from lopd_core.distill.loop.growing_bank import BankGrowth, copy_input_bank, growth_enabled
from lopd_core.distill.loop.loop import export, run_distill
from lopd_core.distill.loop.trainer import Distiller
from lopd_core.distill.teacher import baselines as B
from lopd_core.distill.update import margin as MG
from lopd_core.drivers.bank import bank_paths, make_retriever, open_bank, seed_bank  # noqa: F401  (re-exported)
from lopd_core.drivers.coldstart import new_composer, run_coldstart  # noqa: F401  (re-exported)
from lopd_core.envs import Task
from lopd_core.model.loading import load_policy
from lopd_core.rollout.table import read_trajectories


def starting_composer(params: Params) -> str:
    """The composer distillation starts from and anchors to: the φ fitted in the deployment world (`lopd fit`,
    coldstart.fit_out), or φ0 itself (coldstart.out) when coldstart.fit_steps is 0."""
    cs = params.coldstart
    return cs.fit_out if cs.fit_steps else cs.out


def no_retrieval(tasks: list[Task]) -> list[list[str]]:
    return [[] for _ in tasks]


def method_retriever(spec, bank: ExperienceBank | None, params: Params):
    """The retriever a method's teacher reads: nothing (no bank), J random bank rows per task (the
    `lopd_random_retrieval` control) or the J nearest. One rule for `lopd distill` and `lopd compare`."""
    if bank is None or not spec.uses_bank:
        return no_retrieval
    if spec.teacher.retrieval == "random":
        return B.random_retriever(list(bank.store.load()["experience_text"]), params.bank.top_j, params.seed)
    return make_retriever(bank, params.bank.retrieval)


def seed_rollouts(params: Params) -> int:
    """How many trajectories the bank's seed sampled (charged to a run's rollout budget)."""
    _, seed_path = bank_paths(params)
    if not seed_path.exists():
        raise FileNotFoundError(f"no seed rollouts at {seed_path}: run `lopd bank` first")
    table = read_trajectories(seed_path)
    return int((table["sample_index"] != ORACLE_SAMPLE_INDEX).sum())  # tables written before had oracle rows


def seed_successes(params: Params) -> list[MG.PricingTrajectory]:
    """The bank's stored successful seed rollouts (policy samples, never oracle rows) with their token ids, what
    `lopd.margin: auto` is priced on (margin.py); a seeded subset of MG.MAX_PRICING_TRAJECTORIES when there are
    more; [] when the table is missing or holds no success."""
    _, seed_path = bank_paths(params)
    if not seed_path.exists():
        return []
    table = read_trajectories(seed_path)
    table = table[table["success"] & (table["sample_index"] != ORACLE_SAMPLE_INDEX)]
    rows = [
        MG.PricingTrajectory(Task.from_json(r.task), [int(i) for i in r.token_ids], [int(m) for m in r.action_mask])
        for r in table.itertuples(index=False)
    ]
    if len(rows) > MG.MAX_PRICING_TRAJECTORIES:
        keep = sorted(random.Random(params.seed).sample(range(len(rows)), MG.MAX_PRICING_TRAJECTORIES))
        rows = [rows[i] for i in keep]
    return rows


def pricing_source(
    spec, bank: ExperienceBank | None, params: Params, rows: list[MG.PricingTrajectory]
) -> MG.PricingSource | None:
    """What `lopd.margin: auto` is priced on: the seed successes, their teacher reading the method's retrieval
    with each task's own bank rows left out (the bank holds these very successes: reading one back would price
    copying, not experience). None where nothing is priced before step 1 (margin.py)."""
    if not rows or bank is None or not spec.needs_composer:
        return None
    if spec.teacher.retrieval == "random":
        return MG.PricingSource(rows, method_retriever(spec, bank, params))
    others = dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False)
    return MG.PricingSource(rows, make_retriever(bank, others))


def run_lopd(
    params: Params,
    *,
    resume: bool = True,
    stop_after: int | None = None,
    teacher: str | None = None,
    cycle: int = 0,
    initial_rollouts: int | None = None,
    on_step=None,
    log=print,
) -> dict:
    """Distil a student from `model.name_or_path`. `teacher`: a model whose frozen weights teach instead of the
    student's start (`lopd cycle` with cycle.refresh_teacher false); None: the student's start teaches.
    `initial_rollouts`: trajectories already spent when training starts (None: the bank's seed rollouts; `lopd
    compare` passes what it charges the method). `on_step(distiller, result)`: called after each step, after the
    growing bank's refresh (`lopd compare` evaluates its curve points there)."""
    model, tokenizer, spec, composer = load_inputs(params)
    seed_sampled = seed_rollouts(params) if initial_rollouts is None else initial_rollouts
    priced = spec.composer.margin is None  # `lopd.margin: auto`
    pricing_rows = seed_successes(params) if priced and spec.needs_composer else []  # (the input bank's seeds)
    params, grows = stage_bank(params, spec)
    # a method that reads no bank opens none (`lopd compare` gives it no bank folder)
    with open_bank(params) if spec.uses_bank else contextlib.nullcontext() as bank:
        growth = bank_growth(params, bank, cycle, log) if grows else None
        teacher_base = (
            None if teacher is None else load_policy(dataclasses.replace(params.model, name_or_path=teacher))[0]
        )
        distiller = Distiller(
            params,
            model,
            tokenizer,
            method_retriever(spec, bank, params),
            composer=composer,
            method=spec,
            teacher_base=teacher_base,
            initial_rollouts=seed_sampled,
            pricing=pricing_source(spec, bank, params, pricing_rows),
            log=log,
        )
        hooks = [h for h in (growth, on_step) if h is not None]
        on_each = (lambda d, out: [h(d, out) for h in hooks]) if hooks else None
        state = run_distill(distiller, resume=resume, stop_after=stop_after, on_step=on_each)
        bank_rows = len(bank) if bank is not None else None
    student_dir = export(distiller, Path(params.lopd.out_dir) / "student")
    summary = distill_summary(state, distiller.margin, student_dir, log)
    return summary | {
        "bank_rows": bank_rows,
        "bank_added": growth.added if growth else 0,
        "bank_refreshes": growth.refreshes if growth else [],
        "bank_dir": params.bank.dir if grows else None,
    }


def load_inputs(params: Params):
    """The student's start, its tokenizer, the method (resolved here, once for the run: the trainer is given
    it) and the composer distillation starts from."""
    import torch

    random.seed(params.seed)
    torch.manual_seed(params.seed)  # a composer built fresh (a method without φ0) starts the same every run
    D.setup()  # before loading: under `accelerate launch` on GPUs each rank must land on its own device
    model, tokenizer = load_policy(params.model)
    check_top_k(params.lopd, model)  # the setting first: a later error (no φ0) must not hide it
    spec = M.resolve_method(params.lopd, params.baselines)
    start = starting_composer(params)
    if spec.needs_composer and not Path(start).exists():
        fix = "lopd fit" if params.coldstart.fit_steps else "lopd coldstart"
        raise FileNotFoundError(f"no composer at {start}: run `{fix}` first (the composer distillation starts from)")
    # a method whose teacher reads no latents still owns a composer (unused): φ when there is one, else fresh
    composer = load_composer(start, model, params.composer)
    return model, tokenizer, spec, composer


def bank_growth(params: Params, bank: ExperienceBank, cycle: int, log) -> BankGrowth:
    """The growing bank's per-step hook: the student's successes join the bank every bank.refresh_every steps."""
    b = params.bank
    return BankGrowth(
        bank, every=b.refresh_every, min_reward=b.min_reward, cycle=cycle, total_steps=params.lopd.steps, log=log
    )


def stage_bank(params: Params, spec) -> tuple[Params, bool]:
    """Where a growing bank grows: the stage's own copy of its input bank (growing_bank.py), params pointed at
    it; the params as they are, and False, where the bank does not grow."""
    grows = growth_enabled(params.bank.refresh_every, spec.uses_bank and spec.teacher.retrieval != "random")
    if not grows:
        return params, False
    parquet, index_dir = copy_input_bank(bank_paths(params)[0], params.lopd.out_dir)
    bank = dataclasses.replace(params.bank, dir=str(parquet.parent), index_dir=str(index_dir))
    return dataclasses.replace(params, bank=bank), True


def distill_summary(state, margin: float | None, student_dir: Path, log) -> dict:
    """What the stage reports: steps, β, skips, rollouts, the last row, the student, the m it trained with."""
    # β bounded (margin.beta_unbounded): the β of every step, then the one the last dual ascent left
    betas = [h["row"]["beta"] for h in state.history] + [state.beta]
    unbounded = MG.beta_unbounded(betas)
    if unbounded and D.is_main():
        log(MG.beta_warning(betas))
    # `margin`: the m this run trained with (the resolved method's, or priced: `margin_pricing` says how), what
    # its dashboard draws (and the CSV's `margin` column, step by step)
    return {
        "steps": state.step,
        "beta": state.beta,
        "skipped_updates": state.skipped_updates,
        "rollouts": state.rollouts,
        "last": state.history[-1]["row"] if state.history else {},
        "student": str(student_dir),
        "margin": margin,
        "margin_pricing": state.margin_pricing or None,
        "beta_unbounded": unbounded,
    }

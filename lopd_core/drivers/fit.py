"""The fit stage's driver: φ fitted in the deployment world (lopd_core/distill/composer/world_fit.py).

Reads the teacher's weights (`model.name_or_path`: the frozen base distillation will read with latents), the
composer it starts from (φ0 at `coldstart.out`, or the champion's φ that `lopd cycle` passes), the bank and its
seed rollouts (`bank.dir`); writes the fitted φ to `coldstart.fit_out` and, beside `lopd.csv`, fit.csv.
With `coldstart.fit_steps` 0, or a bank with nothing to read, the starting φ is written as it is (and said so).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lopd_core.config import Params
from lopd_core.distill.composer.coldstart import train_coldstart
from lopd_core.distill.composer.coldstart_data import varied_count
from lopd_core.distill.composer.composer import save_composer
from lopd_core.distill.composer.world_fit import FIT_SEED_OFFSET, cached_retriever, seed_targets, text_teacher_targets
from lopd_core.drivers.bank import bank_paths, make_retriever, open_bank
from lopd_core.drivers.coldstart import load_phi
from lopd_core.envs.mix import deployment_tasks
from lopd_core.model.loading import load_policy
from lopd_core.outputs import file_target
from lopd_core.rollout.engine import Sampling
from lopd_core.rollout.table import read_trajectories


def run_fit(params: Params, *, start: str | None = None, log=print) -> dict:
    """Fit φ in the deployment world from `start` (None: φ0 at coldstart.out); returns the stage's summary."""
    import torch

    cs = params.coldstart
    start = start or cs.out
    if not Path(start).exists():
        raise FileNotFoundError(f"no composer to fit at {start}: run `lopd coldstart` first")
    _, seed_path = bank_paths(params)
    if not seed_path.exists():
        raise FileNotFoundError(f"no seed rollouts at {seed_path}: run `lopd bank` first")
    file_target(cs.fit_out)  # a folder or device named as the output is refused before minutes of fitting
    torch.manual_seed(params.seed)
    model, tokenizer = load_policy(params.model)
    composer = load_phi(params, model, start, refit=True)
    targets = seed_targets(read_trajectories(seed_path))
    summary = {"start": str(start), "out": cs.fit_out, "seed_targets": len(targets), "online_rollouts": 0}
    most = cs.max_experiences or params.bank.top_j  # rows retrieved per target (1..most read: varied_count)
    others = dataclasses.replace(params.bank.retrieval, allow_self_retrieval=False, top_j=most)
    with open_bank(params) as bank:
        retrieve = make_retriever(bank, others)
        if cs.online_rollouts and cs.fit_steps:
            targets += _text_teacher(params, model, tokenizer, retrieve, log)
            summary["online_rollouts"] = cs.online_rollouts
        retrieve, kept = cached_retriever(retrieve, targets)
    retrieve = varied_count(retrieve, cs.max_experiences, params.seed + FIT_SEED_OFFSET)  # 1..N cached rows a step
    summary["targets"] = len(kept)
    if not cs.fit_steps or not kept:
        log(f"fit: {'no target reads a bank row' if cs.fit_steps else 'coldstart.fit_steps is 0'}: φ kept as it is")
        summary.update(fitted=False, first=None, last=None)
    else:
        log(f"fit: φ from {start} on {len(kept)} deployment-world trajectories ({summary['online_rollouts']} fresh)")
        run = train_coldstart(
            model,
            tokenizer,
            composer,
            kept,
            retrieve,
            steps=cs.fit_steps,
            batch_size=cs.fit_batch_size,
            lr=cs.fit_lr,
            kl_weight=1.0,
            nll_weight=0.0,
            seed=params.seed,
            csv_path=Path(params.lopd.csv).with_name("fit.csv"),
            max_experience_tokens=params.composer.max_experience_tokens,
            label="fit",
            log=log,
        )
        seconds = sum(r["step_seconds"] for r in run.rows) / len(run.rows)
        summary.update(
            fitted=True,
            first=run.rows[0],
            last=run.rows[-1],
            skipped_updates=run.skipped_updates,
            seconds_per_step=round(seconds, 4),
        )
    save_composer(composer, Path(cs.fit_out))
    return summary


def _text_teacher(params: Params, model, tokenizer, retrieve, log) -> list:
    """`coldstart.online_rollouts` fresh rollouts of the text teacher on training tasks of the deployment world,
    each reading its nearest bank.top_j rows, as distillation retrieves (however many the fit reads)."""
    tasks = deployment_tasks(params.envs, "train", params.coldstart.online_rollouts, params.seed + FIT_SEED_OFFSET)
    return text_teacher_targets(
        model,
        tokenizer,
        tasks,
        [rows[: params.bank.top_j] for rows in retrieve(tasks)],
        sampling=Sampling.from_rollout(params.rollout),
        batch_size=params.rollout.batch_size,
        seed=params.seed + FIT_SEED_OFFSET,
        log=log,
    )

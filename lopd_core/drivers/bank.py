"""The bank stage's driver: roll out the current policy on training tasks and keep its successes in the bank.

Paths (the `bank` section names the folders):
  bank.dir/experience.parquet       the bank (source of truth)    bank.dir/seed_rollouts.parquet  its inputs
  bank.index_dir/                   the Chroma index (derived)    bank.dir/bank_report.json       the summary
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lopd_core.bank import ExperienceBank, read_bank
from lopd_core.config import Params
from lopd_core.envs.mix import deployment_tasks
from lopd_core.model.chat import make_chat
from lopd_core.model.loading import load_policy, model_path
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
from lopd_core.rollout.table import trajectories_to_frame, write_trajectories


def bank_paths(params: Params) -> tuple[Path, Path]:
    root = Path(params.bank.dir)
    return root / "experience.parquet", root / "seed_rollouts.parquet"


def open_bank(params: Params) -> ExperienceBank:
    parquet, _ = bank_paths(params)
    return ExperienceBank(parquet, index_dir=params.bank.index_dir, chroma_url=params.bank.chroma_url or None,
                          collection=params.bank.collection, hnsw={"ef_search": params.bank.ef_search})


def seed_bank(params: Params, log=print, cycle: int = 0) -> dict:
    """Roll out the current policy on training tasks; keep its successes in the bank (provenance recorded).
    `cycle` is recorded as the new rows' provenance (`lopd cycle` passes the policy's generation). An existing
    bank that cannot be read or breaks the schema fails first, before any rollout is spent or file written."""
    parquet, seed_path = bank_paths(params)
    read_bank(parquet)
    model, tokenizer = load_policy(params.model)
    b, ro = params.bank, params.rollout
    tasks = deployment_tasks(params.envs, "train", b.seed_tasks, params.seed + 101)
    requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(b.samples_per_task)]
    sampling = Sampling(temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                        max_context=ro.max_context,
                        max_observation_tokens=ro.max_observation_tokens)
    trajs = rollout(model, make_chat(tokenizer), requests, sampling=sampling, batch_size=ro.batch_size,
                    seed=params.seed, progress=lambda done, total: log(f"bank: {done}/{total} rollouts")
                    if done % (ro.batch_size * 10) == 0 or done == total else None)
    frame = trajectories_to_frame(trajs)
    write_trajectories(frame, seed_path)
    with open_bank(params) as bank:
        # Only the agent's own samples: no oracle ever reaches a deployment world (coldstart_data.py).
        report = bank.refresh(frame, min_reward=b.min_reward, policy_version=model_path(params.model), cycle=cycle)
        bank.ensure_index()
        size = len(bank)
    summary = {"rollouts": len(trajs), "successes": int(frame["success"].sum()),
               "success_rate": round(float(frame["success"].mean()), 4), "bank_rows": size,
               "refresh": getattr(report, "__dict__", str(report))}
    (parquet.parent / "bank_report.json").write_text(json.dumps(summary, indent=2, default=str))
    log(f"bank: {summary['successes']}/{len(trajs)} successful rollouts; bank has {size} rows")
    return summary


def run_bank(params: Params, *, restart_from: str | None = None, restart: bool = False, cycle: int = 0,
             log=print) -> dict:
    """The bank stage. `lopd bank` adds to the bank at bank.dir as it is. `restart`: the bank folder and its
    index start over, as a copy of the bank in folder `restart_from` (None: empty) — how the cycle gives each
    generation a bank of its own, so earlier banks stay intact and a rejected cycle never changes the
    champion's."""
    if restart:
        parquet, _ = bank_paths(params)
        shutil.rmtree(parquet.parent, ignore_errors=True)
        shutil.rmtree(params.bank.index_dir, ignore_errors=True)
        parquet.parent.mkdir(parents=True)
        if restart_from:
            shutil.copy2(Path(restart_from) / "experience.parquet", parquet)
        log(f"bank: rolling out {model_path(params.model)} on {params.bank.seed_tasks} training tasks "
            f"x {params.bank.samples_per_task} (parent bank: {restart_from or 'none'})")
    return seed_bank(params, log=log, cycle=cycle)

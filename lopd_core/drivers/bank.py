"""The bank stage's driver: roll out the current policy on training tasks and keep its successes in the bank.

`lopd.bank_source` (`lopd bank --source`) picks what is added: the successes of fresh rollouts, the labeled
successes among the served traces at `lopd.traces` (an unlabeled conversation is never a success), or both. Every
trace read is charged as a rollout: it is written to the seed table beside the rollouts, which the budget counts.

Paths (the `bank` section names the folders):
  bank.dir/experience.parquet       the bank (source of truth)    bank.dir/seed_rollouts.parquet  its inputs
  bank.index_dir/                   the Chroma index (derived)    bank.dir/bank_report.json       the summary
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from lopd_core.bank import ExperienceBank, read_bank
from lopd_core.config import Params, RetrievalSettings
from lopd_core.envs import Task
from lopd_core.envs.mix import deployment_tasks
from lopd_core.model.chat import make_chat
from lopd_core.model.loading import load_policy, model_path
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
from lopd_core.rollout.table import trajectories_to_frame, validate_trajectories, write_trajectories
from lopd_core.traces.schema import SERVE_ENV
from lopd_core.traces.source import trace_table


def bank_paths(params: Params) -> tuple[Path, Path]:
    root = Path(params.bank.dir)
    return root / "experience.parquet", root / "seed_rollouts.parquet"


def open_bank(params: Params) -> ExperienceBank:
    parquet, _ = bank_paths(params)
    return ExperienceBank(
        parquet,
        index_dir=params.bank.index_dir,
        chroma_url=params.bank.chroma_url or None,
        collection=params.bank.collection,
        hnsw={"ef_search": params.bank.ef_search},
    )


def make_retriever(bank: ExperienceBank, retrieval: RetrievalSettings):
    """The J nearest experiences' texts per task, under the `bank` section's retrieval settings taken whole
    (`params.bank.retrieval`; `dataclasses.replace` it to change one, e.g. no self-retrieval)."""

    def retrieve(tasks: list[Task]) -> list[list[str]]:
        return [
            [h.experience_text for h in hits]
            for hits in bank.retrieve(
                tasks, retrieval.top_j, retrieval.allow_self_retrieval, same_world=retrieval.same_world
            )
        ]

    return retrieve


def _rollout_frame(params: Params, log):
    """The policy's rollouts on `bank.seed_tasks` training tasks × `bank.samples_per_task`, as a table."""
    model, tokenizer = load_policy(params.model)
    b, ro = params.bank, params.rollout
    tasks = deployment_tasks(params.envs, "train", b.seed_tasks, params.seed + 101)
    requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(b.samples_per_task)]
    sampling = Sampling.from_rollout(ro)
    trajs = rollout(
        model,
        make_chat(tokenizer),
        requests,
        sampling=sampling,
        batch_size=ro.batch_size,
        seed=params.seed,
        progress=lambda done, total: (
            log(f"bank: {done}/{total} rollouts") if done % (ro.batch_size * 10) == 0 or done == total else None
        ),
    )
    return trajectories_to_frame(trajs)


def seed_bank(params: Params, log=print, cycle: int = 0) -> dict:
    """Add the successes of `lopd.bank_source` (the current policy's rollouts on training tasks, the labeled
    traces, or both) to the bank (provenance recorded). `cycle` is recorded as the new rows' provenance (`lopd
    cycle` passes the policy's generation). An existing bank that cannot be read or breaks the schema fails
    first, before any rollout is spent or file written."""
    parquet, seed_path = bank_paths(params)
    read_bank(parquet)
    source = params.lopd.bank_source
    parts = []
    if source in ("rollouts", "both"):
        parts.append(_rollout_frame(params, log))
    if source in ("traces", "both"):
        served = trace_table(params.lopd.traces, labeled_only=False)  # every trace is charged, labeled or not
        log(f"bank: {len(served)} traces from {params.lopd.traces} ({int(served['success'].sum())} labeled successes)")
        parts.append(served)
    frame = validate_trajectories(pd.concat(parts, ignore_index=True)) if len(parts) > 1 else parts[0]
    write_trajectories(frame, seed_path)
    # A trace joins only as a labeled success (reward 1 and success posted), whatever bank.min_reward admits
    # of rollouts: a partial reward posted by a client is not a checked success of the world.
    joins = frame[(frame["env"] != SERVE_ENV) | frame["success"]]
    with open_bank(params) as bank:
        # Only the agent's own samples: no oracle ever reaches a deployment world (coldstart_data.py).
        report = bank.refresh(
            joins, min_reward=params.bank.min_reward, policy_version=_version(params, source), cycle=cycle
        )
        bank.ensure_index()
        size = len(bank)
    summary = {
        "rollouts": len(frame),
        "successes": int(frame["success"].sum()),
        "success_rate": round(float(frame["success"].mean()), 4),
        "bank_rows": size,
        "source": source,
        "traces": int((frame["env"] == SERVE_ENV).sum()),
        "refresh": getattr(report, "__dict__", str(report)),
    }
    (parquet.parent / "bank_report.json").write_text(json.dumps(summary, indent=2, default=str))
    log(
        f"bank: {summary['successes']}/{len(frame)} successful trajectories ({summary['traces']} of them traces); "
        f"bank has {size} rows"
    )
    return summary


def _version(params: Params, source: str) -> str:
    """The rows' policy_version: the rolled-out policy; traces name the served version per row in their task,
    and the bank keeps one version per refresh, so a traces-only refresh records the store it came from."""
    return f"traces:{params.lopd.traces}" if source == "traces" else model_path(params.model)


def run_bank(
    params: Params, *, restart_from: str | None = None, restart: bool = False, cycle: int = 0, log=print
) -> dict:
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
        log(
            f"bank: adding the successes of {params.lopd.bank_source} (policy {model_path(params.model)}, "
            f"parent bank: {restart_from or 'none'})"
        )
    return seed_bank(params, log=log, cycle=cycle)

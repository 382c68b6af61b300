"""`lopd cycle --source traces` end to end on the tiny cycle: the base the cycle builds serves (here: its
trajectories are written to a store with lopd_core.traces' writer, as `lopd serve` records them), the cycle's bank
adds exactly the labeled successes and charges every trace, distillation reads the traces and charges them as
rollouts, and a store that grew re-runs the bank and distillation while the cold start stays cached."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from _tiny_cycle import TINY_CYCLE

LABELS = {0: (1.0, True), 1: (0.5, False), 3: (1.0, True)}  # 2, 4, 5 unlabeled


@pytest.fixture
def project(tmp_path, prefect_harness):
    old_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old_cwd)


def _cycle(*extra) -> None:
    from lopd_cli.main import main

    args = ["cycle", "--source", "traces", "--no-mlflow"]
    for assignment in [*TINY_CYCLE, "lopd.traces=data/traces", "cycle.min_gain=1.0", *extra]:
        args += ["--set", assignment]
    assert main(args) == 0


@pytest.mark.slow
def test_the_cycle_learns_from_traces_and_keys_on_them(project):
    from lopd_cli.main import main
    from lopd_core.config import load_params
    from lopd_core.model.loading import load_policy
    from lopd_core.traces import TraceStore, as_trajectories, trace_table
    from tests.traces._traffic import turn_record, write_store

    sets = [a for s in TINY_CYCLE for a in ("--set", s)]
    assert main(["base", *sets]) == 0
    model, tokenizer = load_policy(load_params("params.yaml", TINY_CYCLE, must_exist=False).model)
    write_store(project / "data/traces", model, tokenizer, n=6, labels=LABELS)
    _cycle()
    (first,) = json.loads((project / "data/cycles/history.json").read_text())
    work = Path(first["csv"]).parent.parent
    (bank_dir,) = work.glob("bank-*")
    report = json.loads((bank_dir / "bank" / "bank_report.json").read_text())
    assert report["source"] == "traces" and report["rollouts"] == report["traces"] == 6
    assert report["refresh"]["added"] == 2  # exactly the labeled successes (0 and 3)
    with open(first["csv"]) as f:
        rows = list(csv.DictReader(f))
    per_step = 2 * 2  # lopd.tasks_per_step × lopd.samples_per_task of the tiny cycle
    assert [int(r["rollouts"]) for r in rows] == [6 + per_step * (i + 1) for i in range(len(rows))]

    store = TraceStore(project / "data/traces", segment_bytes=10**7, max_bytes=10**8)
    store.append(
        turn_record(
            "late",
            as_trajectories(trace_table(project / "data/traces").iloc[:1])[0],
            session="late",
            messages=[{"role": "user", "content": "[cobalt] hi"}],
        )
    )
    store.close()
    _cycle()
    second = json.loads((project / "data/cycles/history.json").read_text())[1]
    assert second["cached"]["coldstart"] and not second["cached"]["bank"] and not second["cached"]["distill"]

"""`lopd compare`: the method comparison (flows/compare.py), added to lopd_cli/main.py's parser.

    lopd compare [--params params.yaml] [--set compare.preset=smoke] [--no-mlflow]

Runs a Prefect flow (a temporary local Prefect server unless PREFECT_API_URL points at one) and writes
reports/compare.md, compare.png and compare.json (compare.report_dir).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from lopd_core.config import Params


def cmd_compare(params: Params, args) -> int:
    from lopd_cli.pipeline import PREFECT_DEFAULTS

    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from flows.compare import compare_flow

    if args.report_only:  # reads finished runs only: no lock, no flow, no MLflow run
        from flows.compare import report_from_disk

        paths = report_from_disk(
            args.params,
            args.overrides,
            command="lopd compare --report-only" + "".join(f" --set {shlex.quote(o)}" for o in args.overrides),
        )
        print(Path(paths["md"]).read_text())
        return 0
    if not args.no_mlflow:
        from tasks.tracking import probe_tracking

        probe_tracking(params.tracking)  # an unusable store is one line now, not minutes of retries later
    command = "lopd compare" + "".join(f" --params {args.params}" if args.params != "params.yaml" else "")
    command += "".join(f" --set {shlex.quote(o)}" for o in args.overrides)
    started = time.perf_counter()
    from flows.stopping import STOP_HOOKS
    from lopd_cli.pipeline import stoppable
    from lopd_core.locks import folder_lock

    # one compare per work folder; SIGTERM or SIGINT stop it cleanly (lopd_cli/pipeline.py `stoppable`)
    stopped_as_cancelled = compare_flow.with_options(**STOP_HOOKS)
    grace = params.compare.stop_grace_s
    with stoppable("lopd compare", grace), folder_lock(params.compare.work_dir, "the compare folder"):
        out = stopped_as_cancelled(
            params_file=args.params, overrides=args.overrides, track=not args.no_mlflow, command=command
        )
    print(Path(out["report"]["md"]).read_text())
    print(
        f"lopd compare: {len(out['runs'])} runs in {(time.perf_counter() - started) / 60:.1f} min; "
        f"report {out['report']['md']}, plot {out['report']['png']}",
        flush=True,
    )
    return 0


def add_compare_parser(stage) -> None:
    p = stage(
        "compare", "every method (LOPD, baselines, ablations) at one rollout budget -> reports/compare.md", cmd_compare
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not record runs in MLflow")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the report from the preset's runs already finished in compare.work_dir (while a comparison "
        "runs, or after one stopped), running nothing",
    )

"""`lopd cycle`, `lopd export`, `lopd report`: the orchestration commands (added to lopd_cli/main.py's parser).

`lopd cycle` runs the Prefect flow of flows/cycle.py (a temporary local Prefect server unless PREFECT_API_URL
points at one). `lopd export` and `lopd report` are plain commands — the DVC stages call them — reading the
single-run layout of params.yaml (data/lopd/student, plots/distill.csv, metrics/*.json); `lopd report --cycles`
draws every cycle of `lopd cycle` instead.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lopd_core.config import Params
from lopd_core.drivers.progress import log

# The first run of a temporary Prefect server creates its database, which can outlast the default start-up
# timeout on a busy 2-core machine (DESIGN §6).
PREFECT_DEFAULTS = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


@contextmanager
def stoppable(command: str, grace_s: float) -> Iterator[None]:
    """The block of a command that runs Prefect flows (`lopd cycle`, `lopd compare`), stopped cleanly by SIGTERM
    or SIGINT (lopd_core/stopping.py): the running stage unwinds, what MLflow runs a thread pool still held end
    KILLED, the watchdog ends the temporary Prefect server (flows/reaper.py), and the process exits with 128 + the
    signal's number within `grace_s` seconds."""
    from flows.reaper import start_reaper
    from lopd_core.stopping import stop_on_signals, stop_requested
    from tasks.tracking import kill_open_runs

    with stop_on_signals(command, grace_s), start_reaper():  # no temporary Prefect server is left behind
        try:
            yield
        finally:
            if stop_requested() is not None:
                kill_open_runs()


def mlflow_ui_hint(params: Params) -> str:
    from tasks.tracking import tracking_uri

    uri = tracking_uri(params.tracking)
    if uri.startswith(("http://", "https://", "databricks")):
        return f"open {uri} (experiment {params.tracking.experiment!r})"
    return f"mlflow ui --backend-store-uri {uri}   # then open http://127.0.0.1:5000"


def cmd_cycle(params: Params, args) -> int:
    if params.lopd.bank_source == "traces" or params.lopd.trajectories != "rollouts":
        from lopd_core.traces.source import require_labeled

        require_labeled(params.lopd.traces)  # no labeled trace: one line before Prefect, MLflow or a base start
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from flows.cycle import cycle_flow
    from lopd_core.drivers.cycle_summary import summarize

    if not args.no_mlflow:
        from tasks.tracking import probe_tracking

        probe_tracking(params.tracking)  # an unusable store is one line now, not minutes of retries later
    started = time.perf_counter()
    log(f"lopd cycle: {args.cycles} cycle(s); state and cached work in {params.cycle.dir}/")
    with stoppable("lopd cycle", params.cycle.stop_grace_s):  # the next cycle resumes from the cached stages
        records = cycle_flow(
            params_file=args.params, overrides=args.overrides, cycles=args.cycles, track=not args.no_mlflow
        )
    print()
    for record in records:
        print("\n".join(summarize(record, params)))
    if not args.no_mlflow:
        print(f"  MLflow UI: {mlflow_ui_hint(params)}")
    print(f"lopd cycle: {len(records)} cycle(s) in {time.perf_counter() - started:.0f}s", flush=True)
    return 0


def cmd_export(params: Params, args) -> int:
    from lopd_core.drivers.export import run_export
    from tasks.caching import content_hash
    from tasks.tracking import dvc_hash, git_commit

    model = args.model or str(Path(params.lopd.out_dir) / "student")
    lineage = {
        "source model": model,
        "source content": content_hash(model)[:16],
        "git commit": git_commit(),
        "bank DVC md5": dvc_hash(params.bank.dir),
        "distill csv": params.lopd.csv,
        "params": args.params + "".join(f" --set {o}" for o in args.overrides),
    }
    if Path(params.lopd.csv).exists():
        import pandas as pd

        frame = pd.read_csv(params.lopd.csv)
        lineage.update(
            {
                "distill steps": int(frame["step"].iloc[-1]),
                "final beta": float(frame["beta"].iloc[-1]),
                "mean delta": round(float(frame["delta"].mean()), 6),
            }
        )
    run_export(params, model, args.out, student_eval=args.eval, base_eval=args.base_eval, lineage=lineage, log=log)
    return 0


def cmd_report(params: Params, args) -> int:
    from lopd_core.drivers.cycle_summary import lineage_points
    from lopd_core.drivers.report import run_report
    from lopd_core.methods import resolve_method

    # the method's m, as the run used it; None under `lopd.margin: auto` (the report reads the CSV's margin column)
    trained_margin = resolve_method(params.lopd, params.baselines).margin
    history_path = Path(params.cycle.dir) / "history.json"
    lineage: list[dict] = []
    if args.cycles:
        if not history_path.exists():
            raise FileNotFoundError(f"no cycle history at {history_path}: run `lopd cycle` first")
        history = json.loads(history_path.read_text())
        runs = [
            {"label": f"cycle {r['cycle']}", "csv": r["csv"], "margin": r.get("margin", trained_margin)}
            for r in history
        ]
        evals = [{"label": "base", "path": history[0]["eval"]["base"]}]
        evals += [{"label": f"cycle {r['cycle']} student", "path": r["eval"]["student"]} for r in history]
        lineage = lineage_points(history)  # the guards' curves across the lineage
        title = "LOPD continual cycles"
    else:
        if not Path(args.csv).exists():
            raise FileNotFoundError(f"no training curves at {args.csv}: run `lopd distill` first (or --cycles)")
        runs = [{"label": "distill", "csv": args.csv, "margin": trained_margin}]
        evals = [{"label": "base", "path": args.base_eval}, {"label": "student", "path": args.eval}]
        title = "LOPD run"
    run_report(runs, evals, args.out, title=title, lineage=lineage, log=log)
    return 0


def _positive_int(text: str) -> int:
    """--cycles: a whole number >= 1 (0 or a negative count used to start building the base anyway)."""
    import argparse

    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a whole number >= 1")
    return int(text)


def add_pipeline_parsers(stage) -> None:
    """Register the three commands with lopd_cli/main.py's `stage(name, help, func)` helper."""
    cycle = stage("cycle", "continual cycles: bank refresh, train, evaluate, export, gated promotion", cmd_cycle)
    cycle.add_argument("--cycles", type=_positive_int, default=1, help="how many cycles to run (default 1)")
    cycle.add_argument("--no-mlflow", action="store_true", help="do not record runs in MLflow")

    export = stage("export", "export the student as a clean Hugging Face checkpoint with a model card", cmd_export)
    export.add_argument("--model", default=None, help="student folder (default: <lopd.out_dir>/student)")
    export.add_argument("--out", default="data/export/student", help="export folder (default: %(default)s)")
    export.add_argument("--eval", default="metrics/eval.json", help="the student's evaluation (model card)")
    export.add_argument("--base-eval", default="metrics/eval_base.json", help="the base's evaluation")

    report = stage("report", "write the offline HTML dashboard and its PNGs", cmd_report)
    report.add_argument(
        "--out", default=None, help="output folder (default: reports/run, or cycle.report_dir with --cycles)"
    )
    report.add_argument("--csv", default=None, help="distill CSV (default: lopd.csv)")
    report.add_argument("--eval", default="metrics/eval.json", help="the student's evaluation")
    report.add_argument("--base-eval", default="metrics/eval_base.json", help="the base's evaluation")
    report.add_argument("--cycles", action="store_true", help="draw every cycle of `lopd cycle` instead")
    report.set_defaults(func=_report_defaults)


def _report_defaults(params: Params, args) -> int:
    args.out = args.out or (params.cycle.report_dir if args.cycles else "reports/run")
    args.csv = args.csv or params.lopd.csv
    return cmd_report(params, args)

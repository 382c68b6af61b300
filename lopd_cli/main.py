"""The `lopd` command line: one subcommand per pipeline stage, all reading the same params.yaml.

    lopd base      [--params params.yaml] [--set section.key=value ...]   build the embedded base policy
    lopd bank      [--params ...] [--set ...] [--source S]  roll out the policy (or read traces), keep successes
    lopd coldstart [--params ...] [--set ...]        train φ0, the composer's cold start, on pretraining worlds
    lopd fit       [--params ...] [--set ...] [--start PHI]   fit φ in the deployment world (KL to the text reading)
    lopd distill   [--params ...] [--set ...] [--fresh]   LOPD training; resumes from the last checkpoint
    lopd evaluate  [--params ...] [--set ...]                               held-out success -> metrics/eval.json
    lopd cycle     [--params ...] [--set ...] [--cycles N]   continual cycles (Prefect flow, MLflow, gated promotion)
    lopd export    [--params ...] [--set ...] [--model DIR] [--out DIR]   clean HF checkpoint + model card
    lopd report    [--params ...] [--set ...] [--cycles]   offline HTML dashboard + PNGs -> reports/
    lopd compare   [--params ...] [--set ...] [--no-mlflow]   every method at one rollout budget -> reports/compare.md
    lopd envs list | check NAME [--n N]   environments that resolve; the contract checker on one of them

Every command takes --params and repeatable --set overrides; a bad key or value stops it before any work, with
the key, the value and what was expected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

import lopd_core  # noqa: F401  (applies the offline defaults before torch/transformers are imported)
from lopd_cli.bench import add_bench_parser
from lopd_cli.compare import add_compare_parser
from lopd_cli.envs import add_envs_parser
from lopd_cli.pipeline import add_pipeline_parsers
from lopd_cli.sandbox import add_sandbox_parser
from lopd_core.config import DEFAULT_PARAMS, ConfigError, Params, load_params, settings_listing
from lopd_core.distributed import is_main
from lopd_core.drivers.progress import log
from lopd_core.errors import StateError
from lopd_core.locks import FolderLocked
from lopd_serve.cli import add_serve_parsers


def cmd_base(params: Params, args) -> int:
    from lopd_core.drivers.base import install_base, run_base

    out = args.out or params.model.base_dir
    if args.install:
        installed = install_base(params, out, log=log)
        log(f"base ({installed['source']}) in {out}: weights sha256 {installed['weights_sha256']}")
        return 0
    report = run_base(params, out, log=log)
    log(
        f"base built in {report.seconds_total:.0f}s: {report.parameters:,} parameters, {report.steps} steps "
        f"({report.epochs_done} epochs), final loss {report.final_loss}"
    )
    return 0


def cmd_bank(params: Params, args) -> int:
    from lopd_core.drivers.bank import run_bank

    summary = run_bank(params, log=log)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_coldstart(params: Params, args) -> int:
    from lopd_core.drivers.coldstart import run_coldstart

    summary = run_coldstart(params, log=log)
    if is_main():  # under `accelerate launch`, rank 0 reports for all
        log(
            f"cold start done: nll {summary['first']['nll']:.3f} -> {summary['last']['nll']:.3f}, "
            f"kl {summary['first']['kl']:.3f} -> {summary['last']['kl']:.3f}; φ0 at {summary['out']}"
        )
    return 0


def cmd_fit(params: Params, args) -> int:
    from lopd_core.drivers.fit import run_fit

    summary = run_fit(params, start=args.start, log=log)
    if summary["fitted"]:
        log(
            f"fit done on {summary['targets']} deployment-world trajectories: kl {summary['first']['kl']:.3f} -> "
            f"{summary['last']['kl']:.3f} ({summary['seconds_per_step']:.2f} s a step); φ at {summary['out']}"
        )
    else:
        log(f"fit: φ unchanged from {summary['start']}, written to {summary['out']}")
    return 0


def cmd_distill(params: Params, args) -> int:
    from lopd_core.drivers.distill import run_lopd

    summary = run_lopd(params, resume=not args.fresh, stop_after=args.stop_after, log=log)
    if is_main():  # under `accelerate launch`, rank 0 reports for all
        log(
            f"distill done: {summary['steps']} steps, {summary['rollouts']} rollouts, β {summary['beta']:.3f}"
            f"{' (beta_unbounded: kept growing)' if summary.get('beta_unbounded') else ''}, margin m "
            f"{'unpriced' if summary['margin'] is None else format(summary['margin'], '.4g')}, "
            f"{summary['skipped_updates']} skipped updates; student at {summary['student']}"
        )
    return 0


def cmd_evaluate(params: Params, args) -> int:
    from lopd_core.drivers.evaluate import run_evaluate
    from lopd_core.evaluation import summary_table
    from lopd_core.outputs import file_target, outside_of

    # a folder, FIFO or device, or a file of the model being evaluated, is refused before minutes of evaluation
    outside_of(
        file_target(args.out or params.eval.out),
        params.model.name_or_path or params.model.base_dir,
        "the model being evaluated",
    )
    if args.task_runner and args.teacher_in_play:
        print("lopd: --teacher-in-play runs in this process: drop --task-runner to use it", file=sys.stderr)
        return 2
    if args.teacher_in_play:  # its composer and bank, before minutes of evaluation
        from lopd_core.drivers.teacher import check_teacher_inputs

        check_teacher_inputs(params)
    if args.task_runner:
        from flows.evaluate_sharded import check_task_runner

        check_task_runner(args.task_runner)  # a bad spec is one line, before any work
    started = time.perf_counter()
    if args.task_runner:  # the shards as mapped Prefect tasks (flows/evaluate_sharded.py); same eval.json
        from flows.evaluate_sharded import run_sharded
        from lopd_cli.pipeline import PREFECT_DEFAULTS

        for key, value in PREFECT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        results = run_sharded(args.params, args.overrides, task_runner=args.task_runner, out=args.out)
        path = args.out or params.eval.out
    else:
        path = args.out or params.eval.out
        results = run_evaluate(params, path, log=log)
    if args.teacher_in_play:  # the same policy as the frozen teacher, beside its own figures in the same file
        from lopd_core.distill.teacher.teacher_play import merge_teacher
        from lopd_core.drivers.teacher import run_teacher_in_play
        from lopd_core.evaluation import write_metrics

        results = merge_teacher(results, run_teacher_in_play(params, log=log))
        write_metrics(results, path)
    log(f"evaluation done in {time.perf_counter() - started:.0f}s -> {path}")
    print(summary_table(results))  # the whole file is at `path`; here, one line per environment, split and mode
    if args.teacher_in_play:
        from lopd_core.distill.teacher.teacher_play import teacher_lines

        for line in teacher_lines(results, params.eval.modes):
            print(f"teacher in play, {line}")
    return 0


# What each command leaves behind (params.yaml keys name the places), for its --help.
WRITES = {
    "base": "model.base_dir (data/base: weights, tokenizer, build_report.json)",
    "bank": "bank.dir (data/bank: experience.parquet, seed_rollouts.parquet, bank_report.json) and its Chroma "
    "index in bank.index_dir",
    "coldstart": "coldstart.out (data/composer/phi0.pt) and plots/coldstart.csv",
    "fit": "coldstart.fit_out (data/composer_fit/phi.pt) and plots/fit.csv",
    "distill": "lopd.out_dir (data/lopd: student, composer, checkpoint) and lopd.csv (plots/distill.csv)",
    "evaluate": "eval.out (metrics/eval.json)",
    "compare": "compare.work_dir (data/compare: one folder per run) and compare.report_dir (reports/compare.md, "
    ".png, .json); MLflow runs unless --no-mlflow",
    "cycle": "cycle.dir (data/cycles: history.json, champion.json, exports/, cached stage work) and "
    "cycle.report_dir; MLflow runs and registry versions unless --no-mlflow",
    "export": "the --out folder (a Hugging Face checkpoint with README.md model card)",
    "report": "the --out folder (default reports/run; cycle.report_dir with --cycles): dashboard HTML and PNGs",
}


def settings_epilog(command: str) -> str:
    """The settings a command reads (tasks/stage_params.py; every one for a command not listed there), each with
    its default and help as lopd_core/settings/ defines them: --help and params.yaml say the same."""
    from tasks.stage_params import STAGES

    only = STAGES[command].params if command in STAGES else ()
    return "settings it reads (--set KEY=VALUE; default shown):\n" + "\n".join(settings_listing(Params(), only))


# Commands that play environments: every environment of the mix is resolved before they start (one line if not).
RESOLVES_ENVS = ("base", "bank", "coldstart", "fit", "distill", "evaluate", "cycle", "compare")


def add_common(p: argparse.ArgumentParser) -> None:
    """--params and --set, which every command takes."""
    p.add_argument(
        "--params",
        default=None,
        help="the run's configuration (default: params.yaml; only the default may be missing, meaning every default)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting of params.yaml (repeatable; the value is read as YAML), e.g. "
        "--set rollout.temperature=0.7; `python -m lopd_core.config --list` lists every setting",
    )


def stage_adder(sub):
    """`stage(name, help, func)`: adds the command of a pipeline stage, whose --help lists what it writes and the
    settings it reads (lopd_cli/pipeline.py and lopd_cli/compare.py add theirs with it too)."""

    def stage(name: str, help_text: str, func):
        description = f"{help_text[0].upper()}{help_text[1:]}." + (
            f" Writes: {WRITES[name]}." if name in WRITES else ""
        )
        p = sub.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(description, 100),
            epilog=settings_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_common(p)
        p.set_defaults(func=func, resolve_envs=name in RESOLVES_ENVS)
        return p

    return stage


def add_stage_parsers(stage) -> None:
    """The stages by hand: base, bank, coldstart, fit, distill, evaluate."""
    base = stage(
        "base",
        "build the embedded base policy (tokenizer, tiny Qwen3, warm start) from the code and say whether it "
        "matches the shipped base; --install: the shipped base (or a build where the settings differ)",
        cmd_base,
    )
    base.add_argument("--out", default=None, help="output directory (default: model.base_dir)")
    base.add_argument(
        "--install",
        action="store_true",
        help="install the base model.base_source names: the shipped copy every published figure rests on (the "
        "default), or a build where model.base_source is build or the build settings differ",
    )
    stage("bank", "roll out the policy on training tasks and keep its successes in the bank", cmd_bank).add_argument(
        "--source",
        choices=SOURCES,
        default=None,
        help="what the bank adds: successes of fresh rollouts, the labeled successes of the served traces at "
        "lopd.traces, or both (sets lopd.bank_source)",
    )
    stage(
        "coldstart", "train the composer's cold start φ0 on oracle successes of the pretraining worlds", cmd_coldstart
    )
    stage(
        "fit",
        "fit φ in the deployment world: KL to the base reading the bank rows as text, on its own rollouts",
        cmd_fit,
    ).add_argument("--start", default=None, help="the composer fitted from (default: coldstart.out, φ0)")
    distill = stage("distill", "LOPD distillation (resumes from the last checkpoint)", cmd_distill)
    distill.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    distill.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # resumption tests
    evaluate_parser = stage("evaluate", "evaluate the policy on held-out tasks -> metrics/eval.json", cmd_evaluate)
    evaluate_parser.add_argument("--out", default=None, help="metrics file (default: eval.out)")
    evaluate_parser.add_argument(
        "--task-runner",
        default=None,
        metavar="SPEC",
        help="run the shards as Prefect tasks: threads[:N], dask[:ADDRESS], ray[:ADDRESS]",
    )
    evaluate_parser.add_argument(
        "--teacher-in-play",
        action="store_true",
        help="also play the policy as the frozen teacher on eval.teacher_splits: alone, reading its bank rows "
        "(bank.dir) as text and as the composer's latents (coldstart.fit_out) -> teacher_in_play in the file",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopd", description="Latent On-Policy Self-Distillation pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    stage = stage_adder(sub)
    add_stage_parsers(stage)
    add_pipeline_parsers(stage)
    sub.choices["cycle"].add_argument(
        "--source",
        choices=SOURCES,
        default=None,
        help="learn from served traffic: the bank adds the traces' labeled successes and distillation takes the "
        "traces as its trajectories (sets lopd.bank_source and lopd.trajectories; lopd.traces names them)",
    )
    add_compare_parser(stage)
    add_bench_parser(sub, add_common)
    add_sandbox_parser(sub, add_common)
    add_envs_parser(sub, add_common)
    add_serve_parsers(sub, add_common)
    return parser


SOURCES = ("rollouts", "traces", "both")
# `--source` of each command, as the settings it stands for (appended to --set: the cycle re-reads them)
SOURCE_SETTINGS = {"bank": ("lopd.bank_source",), "cycle": ("lopd.bank_source", "lopd.trajectories")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "source", None):
        args.overrides += [f"{key}={args.source}" for key in SOURCE_SETTINGS[args.command]]
    explicit = args.params is not None  # a file the user named must exist; only the implicit default may not
    args.params = args.params or DEFAULT_PARAMS
    try:
        params = load_params(args.params, args.overrides, must_exist=explicit)
        if getattr(args, "resolve_envs", False):
            from lopd_core.envs.mix import resolve_mix

            resolve_mix(params.envs)
    except ConfigError as exc:
        print(f"lopd: invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(params, args)
    # a setting that only the model or the data could refute (lopd.top_k against the vocabulary)
    except ConfigError as exc:
        print(f"lopd: invalid configuration: {exc}", file=sys.stderr)
        return 2
    # what is missing, busy or unusable on disk (a model, a checkpoint, a bank, a diverged run): no traceback
    except (FileNotFoundError, FolderLocked, StateError) as exc:
        print(f"lopd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

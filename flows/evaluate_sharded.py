"""`lopd evaluate --task-runner SPEC`: the evaluation as a Prefect flow whose shards are mapped tasks.

    lopd evaluate --task-runner threads:4                      # 4 shards at a time in this process
    lopd evaluate --task-runner dask:tcp://scheduler:8786      # pip install prefect-dask; a Dask cluster
    lopd evaluate --task-runner ray:ray://head:10001           # pip install prefect-ray; a Ray cluster

The flow is the evaluate stage's driver (lopd_core/drivers/evaluate.py) with its shards — environment × split ±
experience × mode — mapped as `evaluate_shard_task`s: the same metrics/eval.json as the in-process `lopd evaluate`
(the external benchmarks of eval.benchmarks, not sharded, run in the flow's own process afterwards). Deployed on a
work pool, the whole flow runs on a worker; its shards follow the task runner.
"""

from __future__ import annotations

from prefect import flow, unmapped

from lopd_core.config import load_params
from lopd_core.drivers.evaluate import run_evaluate
from tasks.eval_shards import evaluate_shard_task
from tasks.stage_tasks import with_paths

TASK_RUNNER_FORMS = "threads[:N] (N >= 1), dask[:ADDRESS] or ray[:ADDRESS]"


def check_task_runner(spec: str) -> None:
    """Refuse a spec `task_runner_for` cannot build, as one line (SystemExit), before any work."""
    kind, _, arg = spec.partition(":")
    if kind not in ("threads", "dask", "ray"):
        raise SystemExit(f"lopd: --task-runner: got {spec!r}, expected {TASK_RUNNER_FORMS}")
    if kind == "threads" and arg and not (arg.isdigit() and int(arg) >= 1):
        raise SystemExit(
            f"lopd: --task-runner: got {spec!r}, expected threads:N with N a whole number >= 1 "
            "(threads alone: as many as Prefect picks)"
        )


def task_runner_for(spec: str):
    """`threads[:N]`, `dask[:ADDRESS]` or `ray[:ADDRESS]` -> a Prefect task runner (no address: a local cluster)."""
    check_task_runner(spec)
    kind, _, arg = spec.partition(":")
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=int(arg) if arg else None)
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as exc:
            raise SystemExit("--task-runner dask needs `pip install prefect-dask`") from exc
        return DaskTaskRunner(address=arg) if arg else DaskTaskRunner()
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as exc:
            raise SystemExit("--task-runner ray needs `pip install prefect-ray`") from exc
        return RayTaskRunner(address=arg) if arg else RayTaskRunner()
    raise SystemExit(f"--task-runner: got {spec!r}, expected {TASK_RUNNER_FORMS}")


@flow(name="lopd-evaluate-sharded", log_prints=True, validate_parameters=False)
def evaluate_sharded_flow(
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    model: str | None = None,
    out: str | None = None,
) -> dict:
    params = load_params(params_file, overrides or [])
    if model:
        params = with_paths(params, model__name_or_path=model)

    def map_shards(shards: list) -> list[dict]:
        return [f.result() for f in evaluate_shard_task.map(unmapped(params), shards)]

    return run_evaluate(params, out or params.eval.out, log=print, map_shards=map_shards)


def run_sharded(
    params_file: str, overrides: list[str], *, task_runner: str, model: str | None = None, out: str | None = None
) -> dict:
    return evaluate_sharded_flow.with_options(task_runner=task_runner_for(task_runner))(
        params_file=params_file, overrides=overrides, model=model, out=out
    )

"""The tracker of the flows (tasks/tracking.py): the NullTracker stands in for MLflow with the same methods, a
stage's child run is open while the stage works and ends FAILED when it raises, registry calls retry only what may
pass on a second try, and the flows build no MlflowClient of their own."""

import inspect
import json
import re
import time
from pathlib import Path

import pytest
from test_pipeline_units import distill_csv, eval_json

from lopd_core.config import Params, TrackingConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tracker(tmp_path):
    from tasks.tracking import Tracker

    return Tracker(TrackingConfig(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="runs"))


def test_the_null_tracker_has_every_method_of_the_tracker():
    from tasks.tracking import NullTracker, Tracker

    public = {name for name, _ in inspect.getmembers(Tracker, inspect.isfunction) if not name.startswith("_")}
    assert {"run", "start_run", "end", "log_metrics", "register_student", "promote"} <= public
    for name in public:
        ours, theirs = getattr(NullTracker, name), getattr(Tracker, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    null = NullTracker()
    with null.run("stage", parent=None, tags={"a": 1}) as run:
        assert run is None
        assert null.register_student(run, "export") is None and null.find_version("t", "v") is None


def _report_args(tmp_path: Path) -> tuple[list[dict], list[dict]]:
    student = tmp_path / "eval.json"
    student.write_text(json.dumps(eval_json(0.4, 0.6)))
    return (
        [{"label": "distill", "csv": str(distill_csv(tmp_path / "distill.csv")), "margin": 0.05}],
        [{"label": "student", "path": str(student)}],
    )


def _child(tracker, parent: str, name: str):
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    return next(r for r in runs if r.info.run_name == name)


def test_a_stages_child_run_is_open_while_it_works(tracker, tmp_path, prefect_harness):
    """The report's files are written between the child run's start and end: the run's duration is the stage's
    (it used to open after the work, lasting a few milliseconds)."""
    from flows.stage_flows import report_flow

    parent = tracker.start_run("cycle-1")
    runs, evals = _report_args(tmp_path)
    out = tmp_path / "report"
    report_flow.fn(Params(), runs, evals, str(out), "a run", [], parent_run=parent, cycle=1, tracker=tracker)
    child = _child(tracker, parent, "report")
    written_ms = (out / "index.html").stat().st_mtime * 1000
    assert child.info.status == "FINISHED" and child.data.tags["lopd.stage"] == "report"
    assert child.info.start_time <= written_ms <= child.info.end_time


def test_a_stage_that_raises_leaves_a_failed_child_run(tracker, tmp_path, prefect_harness):
    """The report refuses a folder of the user's (outputs.check_folder): the stage fails, and so does its run."""
    from flows.stage_flows import report_flow
    from lopd_core.outputs import OutputPathError

    parent = tracker.start_run("cycle-1")
    runs, evals = _report_args(tmp_path)
    theirs = tmp_path / "my-notes"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("not a report")
    started_ms = time.time() * 1000
    with pytest.raises(OutputPathError):
        report_flow.fn(Params(), runs, evals, str(theirs), "a run", [], parent_run=parent, cycle=1, tracker=tracker)
    child = _child(tracker, parent, "report")
    assert child.info.status == "FAILED"
    assert child.info.start_time >= started_ms - 1000 and child.info.end_time >= child.info.start_time
    assert (theirs / "notes.txt").read_text() == "not a report"


def test_registry_calls_retry_transient_errors_and_nothing_else():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    from tasks.tracking import registry_call

    calls = []

    def busy_once():
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        return "3"

    assert registry_call(busy_once, "registering", delay_s=0) == "3" and len(calls) == 2

    calls.clear()

    def missing():
        calls.append(1)
        raise MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST)

    with pytest.raises(MlflowException, match="no such model"):
        registry_call(missing, "searching", delay_s=0)
    assert len(calls) == 1  # a definite answer is not asked again

    calls.clear()

    def always_down():
        calls.append(1)
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        registry_call(always_down, "promoting", attempts=3, delay_s=0)
    assert len(calls) == 3


def test_no_deterministic_local_task_retries():
    """Retries sit on the registry calls: a task that exports, reports or evaluates locally fails the same way
    again, so retrying it only delays the error."""
    from flows.compare import compare_run_task
    from tasks import stage_tasks as T
    from tasks.eval_shards import evaluate_shard_task

    for task in (
        T.build_base_task,
        T.refresh_bank_task,
        T.coldstart_task,
        T.distill_task,
        T.evaluate_task,
        T.export_task,
        T.report_task,
        evaluate_shard_task,
        compare_run_task,
    ):
        assert not task.retries, task.name


def test_prefect_records_the_tracker_by_name_only(tracker):
    """A flow's parameters are stored by Prefect: the tracker must not spill its store URI or client there."""
    from flows.stage_flows import evaluate_flow
    from tasks.tracking import NULL_TRACKER

    assert evaluate_flow.serialize_parameters({"tracker": tracker}) == {"tracker": "<Tracker>"}
    assert evaluate_flow.serialize_parameters({"tracker": NULL_TRACKER}) == {"tracker": "<NullTracker>"}


def test_the_flows_build_no_mlflow_client_of_their_own():
    """One MlflowClient per command: the cycle and compare make one tracker (make_tracker) and pass it down."""
    built = {
        path.relative_to(ROOT).as_posix()
        for folder in ("flows", "tasks")
        for path in (ROOT / folder).glob("*.py")
        if re.search(r"\bTracker\(|MlflowClient\(", path.read_text())
    }
    assert built == {"tasks/tracking.py"}

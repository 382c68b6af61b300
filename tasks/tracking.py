"""MLflow lineage of the pipeline: one parent run per cycle, one child run per stage, the student registry.

Where runs go: `tracking.mlflow_uri` (a SQLite file in the project by default), overridden by the environment
variable MLFLOW_TRACKING_URI (a server, another file). Everything goes through `MlflowClient` with explicit run
ids, never the fluent "active run" (it is per thread, and Prefect may run a task in another thread). The one
exception is model logging, which MLflow only offers fluently: it is wrapped in a resumed run on this thread.

Names are the observable contract (DESIGN §5): step metrics carry the plots/distill.csv column names (β as
`beta` and δ̄ as `delta`, every step); params are params.yaml flattened with dots; tags carry the git commit,
the DVC hash of the bank and the parent cycle run.

A run with MLflow off (`--no-mlflow`) gets a `NullTracker`: the same methods, doing nothing, so no flow asks
whether it is tracked. A stage's run opens before its work (`Tracker.run`, a context manager) and ends FAILED when
the work raises, so its duration is the stage's and a failed stage shows as failed. The flows of one command share
one tracker, hence one MlflowClient. Registry calls (register, search, alias) are retried on errors that say
"try again" (`registry_call`); the local work around them is deterministic and is not.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pandas as pd

from lopd_core.config import TrackingConfig
from lopd_core.export import eval_rows
from lopd_core.stopping import stop_requested

STAGE_TAG = "lopd.stage"
CYCLE_TAG = "lopd.cycle"
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-./ ]")


def tracking_uri(cfg: TrackingConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow_uri


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"lopd": {"margin": 0.05}} -> {"lopd.margin": "0.05"}: params.yaml as MLflow params."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)[:6000]
    return flat


def git_commit(root: str | Path = ".") -> str:
    """HEAD's commit, suffixed `-dirty` when tracked files differ from it; `unknown` outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dvc_hash(path: str | Path) -> str:
    """The md5 DVC records for `path` in dvc.lock (`<md5>.dir` for a folder): the bank's version id, so a run
    can be matched to the bank that `dvc checkout` restores."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs.local import LocalFileSystem

    if not Path(path).exists():
        return "missing"
    fs = LocalFileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        _, _, obj = build(HashFileDB(fs, scratch), str(path), fs, "md5")
    return obj.hash_info.value


def metric_name(name: str) -> str:
    return _METRIC_NAME.sub("_", name.replace("+", "_"))


def eval_metrics(results: dict | None, prefix: str = "eval") -> dict[str, float]:
    """metrics/eval.json as flat metrics: eval.toolworld.test_id.greedy.success_rate, ..."""
    out = {}
    for env, split, mode, cell in eval_rows(results):
        for field in ("success_rate", "reward_mean"):
            out[metric_name(f"{prefix}.{env}.{split}.{mode}.{field}")] = float(cell[field])
    for bench in ("bfcl", "acebench", "humaneval"):  # eval.benchmarks sections: every number they hold
        for path, value in _numbers((results or {}).get(bench), f"{prefix}.{bench}"):
            out[metric_name(path)] = value
    return out


def _numbers(node, path: str):
    """(dotted path, value) for each int/float leaf of a nested dict (booleans and strings are not metrics)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, float(node)


OWNER_PID_TAG, OWNER_HOST_TAG = "lopd.pid", "lopd.host"  # which process may still close the run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


# MLflow error codes that a later attempt may not meet: a busy SQLite file, a server restarting or throttling.
TRANSIENT_CODES = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})
REGISTRY_ATTEMPTS = 3
_T = TypeVar("_T")


def registry_call(call: Callable[[], _T], what: str, *, attempts: int = REGISTRY_ATTEMPTS, delay_s: float = 2.0) -> _T:
    """`call()`, tried up to `attempts` times while it fails with a transient error (an OSError, or an
    MlflowException whose code is in TRANSIENT_CODES); any other error, or the last attempt's, goes on at once.
    Why here and not on the Prefect tasks: the registry is the part of a stage that talks to a shared service;
    the export and report before it are local and deterministic, and would fail again the same way."""
    from mlflow.exceptions import MlflowException

    for attempt in range(1, attempts + 1):
        try:
            return call()
        except (MlflowException, OSError) as exc:
            transient = isinstance(exc, OSError) or getattr(exc, "error_code", None) in TRANSIENT_CODES
            if not transient or attempt == attempts:
                raise
            print(
                f"MLflow registry: {what} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                f"attempt {attempt + 1} of {attempts} in {delay_s:g}s",
                flush=True,
            )
            time.sleep(delay_s)
    raise AssertionError("unreachable")


def stopped_by(exc: BaseException) -> bool:
    """Whether `exc` unwinds a stop the user asked for: Ctrl-C, lopd_core/stopping.py's StopRequested, Prefect's
    TerminationSignal (its SIGTERM handler while a flow runs), or any exception once such a signal arrived."""
    from prefect.exceptions import TerminationSignal

    return isinstance(exc, (KeyboardInterrupt, TerminationSignal)) or stop_requested() is not None


class _Runs:
    """What Tracker and NullTracker share: a run as a context manager over their start_run and end."""

    __slots__ = ()

    @contextmanager
    def run(self, name: str, *, parent: str | None = None, tags: dict | None = None) -> Iterator[str | None]:
        """A run opened before the work it records and ended after it: FINISHED, FAILED when the work raises, or
        KILLED when a stop (SIGTERM, SIGINT: lopd_core/stopping.py) ends it; the exception goes on. Yields the run
        id (None when not tracked)."""
        run_id = self.start_run(name, parent=parent, tags=tags)
        try:
            yield run_id
        except BaseException as exc:
            self.end(run_id, "KILLED" if stopped_by(exc) else "FAILED")
            raise
        self.end(run_id)


class NullTracker(_Runs):
    """The tracker of a run with MLflow off: every method of Tracker, recording nothing (run ids are None,
    registry versions None)."""

    __slots__ = ()

    def start_run(self, name: str, *, parent: str | None = None, tags: dict | None = None) -> None:
        return None

    def close_abandoned_runs(self) -> list[str]:
        return []

    def end(self, run_id, status: str = "FINISHED") -> None:
        pass

    def set_tags(self, run_id, tags: dict) -> None:
        pass

    def log_params(self, run_id, params: dict) -> None:
        pass

    def log_metrics(self, run_id, metrics: dict[str, float], step: int = 0) -> None:
        pass

    def log_step_metrics(self, run_id, csv_path: str | Path) -> int:
        return 0

    def log_artifact(self, run_id, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def register_student(self, run_id, export_dir: str | Path, tags: dict | None = None) -> None:
        return None

    def find_version(self, tag: str, value: str) -> None:
        return None

    def champion_version(self) -> None:
        return None

    def promote(self, version) -> None:
        pass


NULL_TRACKER = NullTracker()


def make_tracker(cfg: TrackingConfig, track: bool) -> Tracker | NullTracker:
    """The one tracker of a command: MLflow's when `track`, else the NullTracker."""
    return Tracker(cfg) if track else NULL_TRACKER


class Tracker(_Runs):
    """The pipeline's MLflow client: experiment, runs, metrics, artifacts, registry.

    Slotted: Prefect records a flow's parameters, and a plain object would be recorded field by field (the store's
    URI with whatever credentials it holds, the client's internals); without a __dict__ it is recorded as
    `<Tracker>`."""

    __slots__ = ("cfg", "client", "experiment_id", "uri")

    def __init__(self, cfg: TrackingConfig):
        from mlflow import MlflowClient

        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.experiment_id = self._experiment()

    def _experiment(self) -> str:
        found = self.client.get_experiment_by_name(self.cfg.experiment)
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):  # artifacts beside the database, not in the working directory
            db = Path(self.uri.split(":///", 1)[-1])
            location = (db.parent.resolve() / "mlruns").as_uri()
        return self.client.create_experiment(self.cfg.experiment, artifact_location=location)

    # ---- runs ---------------------------------------------------------------------------------------
    def start_run(self, name: str, *, parent: str | None = None, tags: dict | None = None) -> str:
        tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent:
            tags[PARENT_TAG] = parent
        tags.update({OWNER_PID_TAG: str(os.getpid()), OWNER_HOST_TAG: socket.gethostname()})
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        with _OPEN_LOCK:
            _OPEN_RUNS[run_id] = self
        return run_id

    def close_abandoned_runs(self) -> list[str]:
        """Runs left RUNNING by a process of this host that no longer exists (a crash, `kill -9`): ended as
        FAILED, so the UI does not show them running forever. Runs of other hosts, or of live processes,
        are left alone. Returns the ids it closed."""
        host = socket.gethostname()
        closed = []
        for run in self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING'", max_results=1000):
            tags = run.data.tags
            if tags.get(OWNER_HOST_TAG) != host or not tags.get(OWNER_PID_TAG, "").isdigit():
                continue
            if _alive(int(tags[OWNER_PID_TAG])):
                continue
            self.client.set_tag(
                run.info.run_id, "lopd.closed_reason", f"its process {tags[OWNER_PID_TAG]} ended without closing it"
            )
            self.client.set_terminated(run.info.run_id, status="FAILED")
            closed.append(run.info.run_id)
        if closed:
            print(f"MLflow: closed {len(closed)} run(s) left RUNNING by an ended process as FAILED", flush=True)
        return closed

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)
        with _OPEN_LOCK:
            _OPEN_RUNS.pop(run_id, None)

    def set_tags(self, run_id: str, tags: dict) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, key, str(value))

    def log_params(self, run_id: str, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit for params
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_step_metrics(self, run_id: str, csv_path: str | Path) -> int:
        """Every row of a distill CSV as step metrics named by its columns; returns the number of steps."""
        from mlflow.entities import Metric

        frame = pd.read_csv(csv_path)
        now = int(time.time() * 1000)
        items = [
            Metric(col, float(row[col]), now, int(row["step"]))
            for _, row in frame.iterrows()
            for col in frame.columns
            if col != "step" and pd.notna(row[col])
        ]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])
        return len(frame)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        elif path.exists():
            self.client.log_artifact(run_id, str(path), artifact_path)

    # ---- registry -----------------------------------------------------------------------------------
    def register_student(self, run_id: str, export_dir: str | Path, tags: dict | None = None) -> str:
        """Log the exported (merged) checkpoint under `run_id` and register it; returns the version number."""
        import mlflow
        import mlflow.transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(export_dir)
        tokenizer = AutoTokenizer.from_pretrained(export_dir)
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_registry_uri(self.uri)
        import torch
        import transformers

        requirements = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"]

        def log_and_register():
            with mlflow.start_run(run_id=run_id):
                return mlflow.transformers.log_model(
                    transformers_model={"model": model, "tokenizer": tokenizer},
                    name="student",
                    task="text-generation",
                    pip_requirements=requirements,
                    registered_model_name=self.cfg.registered_model,
                )

        version = str(registry_call(log_and_register, "registering the student").registered_model_version)
        for key, value in (tags or {}).items():
            registry_call(
                lambda k=key, v=value: self.client.set_model_version_tag(self.cfg.registered_model, version, k, str(v)),
                "tagging the version",
            )
        return version

    def find_version(self, tag: str, value: str) -> str | None:
        """The registered version carrying tag=value (e.g. the same student content), if any."""
        from mlflow.exceptions import MlflowException

        try:
            versions = registry_call(
                lambda: self.client.search_model_versions(f"name='{self.cfg.registered_model}'"),
                "searching the versions",
            )
        except MlflowException:
            return None
        for v in versions:
            if v.tags.get(tag) == value:
                return str(v.version)
        return None

    def champion_version(self) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(
                registry_call(
                    lambda: self.client.get_model_version_by_alias(self.cfg.registered_model, self.cfg.champion_alias),
                    "reading the champion alias",
                ).version
            )
        except MlflowException:
            return None

    def promote(self, version: str) -> None:
        """Move the champion alias to `version` (call only when the promotion gate passed)."""
        registry_call(
            lambda: self.client.set_registered_model_alias(self.cfg.registered_model, self.cfg.champion_alias, version),
            "moving the champion alias",
        )


# Runs this process opened and has not ended, whatever thread opened them: what a stop ends as KILLED.
_OPEN_RUNS: dict[str, Tracker] = {}
_OPEN_LOCK = threading.Lock()


def kill_open_runs() -> list[str]:
    """End every run this process still holds open as KILLED; returns their ids. Why: a stop (SIGTERM, SIGINT)
    unwinds the main thread, whose runs end KILLED on the way (`Tracker.run`), but a task that a thread pool runs
    (`lopd compare`'s mapped runs) is not unwound, and its run would stay RUNNING until the next command closed it
    as FAILED."""
    with _OPEN_LOCK:
        held = list(_OPEN_RUNS.items())
    for run_id, tracker in held:
        with contextlib.suppress(Exception):  # one line per run is said by the caller; a dead store ends nothing
            tracker.end(run_id, "KILLED")
    return [run_id for run_id, _ in held]


NO_MLFLOW_HINT = "or run with --no-mlflow"


def probe_tracking(cfg: TrackingConfig, timeout_s: float = 5.0) -> None:
    """Check, before any work, that the tracking store can be written; raise TrackingUnavailable (one line with
    the URI and the way out) if not. Why: an unreachable server made MLflow's client retry for minutes before a
    long traceback, and a read-only or corrupt SQLite file failed deep inside its migrations; both after the
    command had started its work. A server gets one short request; a SQLite file is opened and a write begun
    (and rolled back); then the client reads the experiment as the run will."""
    import sqlite3
    import urllib.error
    import urllib.request

    from lopd_core.errors import TrackingUnavailable

    uri = tracking_uri(cfg)
    elsewhere = "point MLFLOW_TRACKING_URI or tracking.mlflow_uri at a store you can write"

    def fail(why: str, fix: str = elsewhere) -> None:
        raise TrackingUnavailable(f"MLflow tracking store {uri}: {why}; {fix}, {NO_MLFLOW_HINT}")

    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        except urllib.error.HTTPError as exc:  # it answered: reachable (an old server may lack /health)
            if exc.code >= 500:
                fail(f"the server answers {exc.code} ({exc.reason})", "check the server")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            fail(f"unreachable within {timeout_s:g}s ({reason})", "start the server, or " + elsewhere)
        return
    if uri.startswith("sqlite:"):
        db = Path(uri.split(":///", 1)[-1]) if ":///" in uri else None
        if db is None or not str(db):
            fail("not a sqlite:///PATH URI")
        if db.exists():
            if not db.is_file():
                fail("the database path is not a file")
            try:
                con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=timeout_s)
                try:
                    con.execute("SELECT count(*) FROM sqlite_master").fetchone()
                    con.execute("BEGIN IMMEDIATE")  # a write can begin: not read-only, not locked for good
                    con.rollback()
                finally:
                    con.close()
            except sqlite3.DatabaseError as exc:  # sqlite3.OperationalError (read-only, locked) is one too
                fail(f"the database file cannot be used ({exc})", "restore or remove the file, or " + elsewhere)
        elif not db.parent.is_dir():
            fail(f"its folder {db.parent} does not exist")
        elif not os.access(db.parent, os.W_OK):
            fail(f"its folder {db.parent} cannot be written")
    try:  # what the run does first: the experiment, read (or created) through the client
        Tracker(cfg)
    except Exception as exc:  # noqa: BLE001  MLflow raises many kinds; each is this one line
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"{type(exc).__name__}: {what[:300]}")

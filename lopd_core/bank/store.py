"""The experience bank's source of truth: one parquet file of validated rows.

`refresh` turns a trajectory table (`lopd_core.rollout.table.trajectories_to_frame`) into bank rows: it keeps the
trajectories with reward >= min_reward, builds each one's experience text with `experience_text`, records
provenance (policy_version, cycle, created_at in UTC), drops duplicates (same task_id + same chain, within the
batch or already banked; the first occurrence and its provenance win) and appends. Every new row is checked
before anything is written; if any row is bad the whole refresh is rejected with all failures listed, and the
file on disk is untouched. Writes go to a temporary file in the same folder, then `os.replace` — a crash never
leaves half a bank behind and the old file stays intact on any failure.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lopd_core.bank.schema import (
    BANK_COLUMNS,
    CREATED_AT_DTYPE,
    BankValidationError,
    empty_bank_frame,
    failure_frame,
    row_key,
    sort_failures,
    validate_bank,
)
from lopd_core.envs import Task
from lopd_core.errors import StateError
from lopd_core.experience import experience_text
from lopd_core.locks import folder_lock
from lopd_core.outputs import atomic_write

BANK_LOCK_WAIT_S = 600.0  # a refresh is seconds of work: a second writer waits its turn rather than fail
_REJECTED = "trajectories offered to the bank (refresh rejected; the bank file is unchanged)"
TRAJECTORY_COLUMNS = ("task_id", "env", "split", "template", "world", "reward", "episode", "task")


@dataclass(frozen=True)
class RefreshReport:
    trajectories: int  # rows offered
    below_min_reward: int  # dropped: reward < min_reward
    duplicates: int  # dropped: same task_id + chain as a row of this batch or of the bank
    added: int
    total: int  # rows in the bank after the refresh
    content_hash: str  # of the bank after the refresh


def _utc_now() -> pd.Timestamp:
    return pd.Timestamp.now(tz="UTC")


def _as_utc(ts) -> pd.Timestamp:
    ts = pd.Timestamp(ts)
    if ts.tzinfo is None:
        raise ValueError(f"created_at must be timezone-aware (UTC), got naive {ts!r}")
    return ts.tz_convert("UTC")


def _normalise_loaded(frame: pd.DataFrame) -> pd.DataFrame:
    """Undo what parquet may vary (timestamp unit) without hiding real errors (a naive timestamp stays naive)."""
    frame = frame.copy()
    if "created_at" in frame and isinstance(frame["created_at"].dtype, pd.DatetimeTZDtype):
        frame["created_at"] = frame["created_at"].dt.tz_convert("UTC").dt.as_unit("us")
    return frame


def bank_content_hash(frame: pd.DataFrame) -> str:
    """Hash of the bank's content, independent of row order and of how parquet encodes it."""
    h = hashlib.sha256()
    h.update("\x1f".join(BANK_COLUMNS).encode())
    if len(frame):
        cols = [frame[c].astype(str).tolist() for c in BANK_COLUMNS]
        for row in sorted(zip(*cols)):
            h.update(b"\x1e")
            h.update("\x1f".join(row).encode("utf-8"))
    return h.hexdigest()


class BankFileError(StateError):
    """The bank's parquet file exists but cannot be read as a table (truncated, overwritten, not parquet)."""


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        detail = " ".join(str(exc).split())[:160]
        raise BankFileError(
            f"{path}: not a readable parquet file ({type(exc).__name__}: {detail}); it is the "
            "bank's source of truth and was left as it is: restore it (e.g. `dvc checkout`) or "
            "move it aside to start an empty bank"
        ) from None


def read_bank(path: str | Path) -> pd.DataFrame:
    """The bank at `path` (validated); an empty bank when the file does not exist. An unreadable file raises
    BankFileError, rows that break the schema BankValidationError: both name the file."""
    path = Path(path)
    if not path.exists():
        return empty_bank_frame()
    return validate_bank(_normalise_loaded(_read_parquet(path)), what=f"rows of {path}")


def write_bank(frame: pd.DataFrame, path: str | Path) -> Path:
    """Validate, then write atomically (outputs.atomic_write: a temporary file beside it, then a rename)."""
    path = Path(path)
    frame = validate_bank(frame[list(BANK_COLUMNS)].reset_index(drop=True))
    with atomic_write(path) as fh:
        frame.to_parquet(fh, index=False)
    return path


def trajectories_to_rows(
    trajectories: pd.DataFrame,
    *,
    min_reward: float,
    policy_version: str,
    cycle: int,
    created_at=None,
) -> tuple[pd.DataFrame, int]:
    """Candidate bank rows from a trajectory table (index kept, so failures name the input rows).

    Returns (rows, number dropped for reward < min_reward). Rows whose reward is not a number in [0, 1] are kept
    as candidates so that validation rejects them instead of the filter hiding them. Raises BankValidationError
    listing every row that cannot be turned into an experience or breaks the schema.
    """
    missing = [c for c in TRAJECTORY_COLUMNS if c not in trajectories.columns]
    if missing:
        raise BankValidationError(
            failure_frame(
                [{"index": None, "column": c, "check": "column_in_dataframe", "failure_case": c} for c in missing]
            ),
            what="trajectory columns",
        )
    stamp = _as_utc(created_at) if created_at is not None else _utc_now()
    reward = pd.to_numeric(trajectories["reward"], errors="coerce").astype(float)
    invalid = reward.isna() | (reward < 0.0) | (reward > 1.0)
    keep = (reward >= min_reward) | invalid
    below = int((~keep).sum())
    kept = trajectories.loc[keep]

    rows, errors = [], []
    for label, traj in kept.iterrows():
        parsed = _experience_of(label, traj)
        if isinstance(parsed, dict):
            errors.append(parsed)
            continue
        task, text = parsed
        if task.task_id != traj["task_id"]:
            errors.append(_failure(label, "task", "task JSON has the row's task_id", task.task_id))
        rows.append(
            _candidate_row(traj, task, text, reward.loc[label], policy_version, cycle, stamp) | {"_label": label}
        )
    labels = [r.pop("_label") for r in rows]
    if not rows:
        if errors:
            raise BankValidationError(failure_frame(errors), what=_REJECTED)
        return empty_bank_frame(), below
    frame = _candidate_frame(rows, labels, cycle)
    failures = [failure_frame(errors)] if errors else []
    try:
        # Duplicates are not failures: check the schema on the first occurrence of each row_id only.
        validate_bank(frame.loc[~frame["row_id"].duplicated()], what="new rows")
    except BankValidationError as err:
        failures.append(err.failure_cases)
    if failures:
        raise BankValidationError(sort_failures(pd.concat(failures, ignore_index=True)), what=_REJECTED)
    return frame, below


def _failure(label, column: str, check: str, case) -> dict:
    """One failure case of a trajectory row, in the validation report's shape."""
    return {"index": label, "column": column, "check": check, "failure_case": case}


def _experience_of(label, traj) -> tuple[Task, str] | dict:
    """A trajectory row's task and experience text, or the failure case that says why it has none."""
    try:
        task = Task.from_json(traj["task"])
    except (TypeError, ValueError, KeyError) as exc:
        return _failure(label, "task", "Task JSON parses", f"{type(exc).__name__}: {exc}")
    try:
        episode = json.loads(traj["episode"])
        if not isinstance(episode, list) or not all(isinstance(t, dict) for t in episode):
            raise ValueError("not a JSON list of per-turn objects")
        return task, experience_text(task, episode)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return _failure(label, "episode", "episode JSON formats as an experience", f"{type(exc).__name__}: {exc}")


def _candidate_row(traj, task: Task, text: str, reward, policy_version: str, cycle: int, stamp) -> dict:
    """The bank row a trajectory becomes: its experience text, and the chain that keys it (the text after the
    instruction)."""
    prefix = task.instruction + "\n"
    chain = text[len(prefix) :] if text.startswith(prefix) else ""
    return {
        "row_id": row_key(str(traj["task_id"]), chain),
        "task_id": traj["task_id"],
        "env": traj["env"],
        "split": traj["split"],
        "template": traj["template"],
        "world": traj["world"],
        "task_text": task.instruction,
        "chain": chain,
        "experience_text": text,
        "reward": reward,
        "policy_version": policy_version,
        "cycle": cycle,
        "created_at": stamp,
    }


def _candidate_frame(rows: list[dict], labels: list, cycle: int) -> pd.DataFrame:
    """The candidate rows as a bank frame, indexed by the input rows' labels, in the bank's dtypes."""
    frame = pd.DataFrame(rows, columns=list(BANK_COLUMNS), index=pd.Index(labels, dtype=object))
    frame["reward"] = frame["reward"].astype(float)
    frame["created_at"] = pd.Series(list(frame["created_at"]), index=frame.index, dtype=CREATED_AT_DTYPE)
    if pd.api.types.is_integer(cycle):
        frame["cycle"] = frame["cycle"].astype("int64")
    return frame


class BankStore:
    """The parquet file of the experience bank."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> pd.DataFrame:
        return read_bank(self.path)

    def write(self, frame: pd.DataFrame) -> Path:
        return write_bank(frame, self.path)

    def refresh(
        self,
        trajectories: pd.DataFrame,
        *,
        min_reward: float,
        policy_version: str,
        cycle: int,
        created_at=None,
    ) -> RefreshReport:
        """Append the successes of `trajectories`; see the module docstring. All-or-nothing. The read, merge
        and write hold the bank's lock, so concurrent refreshes queue and none loses another's rows."""
        with folder_lock(self.path.parent, "the experience bank", wait_s=BANK_LOCK_WAIT_S, log=print):
            return self._refresh_locked(
                trajectories, min_reward=min_reward, policy_version=policy_version, cycle=cycle, created_at=created_at
            )

    def _refresh_locked(
        self, trajectories: pd.DataFrame, *, min_reward: float, policy_version: str, cycle: int, created_at=None
    ) -> RefreshReport:
        existing = self.load()
        new, below = trajectories_to_rows(
            trajectories, min_reward=min_reward, policy_version=policy_version, cycle=cycle, created_at=created_at
        )
        fresh = new.loc[~new["row_id"].duplicated() & ~new["row_id"].isin(set(existing["row_id"]))]
        duplicates = len(new) - len(fresh)
        if len(fresh):
            parts = [f for f in (existing, fresh.reset_index(drop=True)) if len(f)]
            merged = pd.concat(parts, ignore_index=True)
            self.write(merged)
        else:
            merged = existing
        return RefreshReport(
            trajectories=len(trajectories),
            below_min_reward=below,
            duplicates=duplicates,
            added=len(fresh),
            total=len(merged),
            content_hash=bank_content_hash(merged),
        )

"""Rows of the experience bank: one past success each, guarded by a pandera schema.

A row is a task instance (task_id, env, split, template, world, task_text) and the compact action -> result
chain that solved it; `experience_text` is what a model reads (task_text + "\n" + chain, as
`lopd_core.experience.format_experience` writes it). Provenance says which policy produced it, in which cycle and
when (UTC). `row_id` is the content hash of (task_id, chain): two trajectories that solved the same task instance
with the same chain are one experience, so the bank de-duplicates on it, and the Chroma index uses it as the id.

Validation is lazy: `validate_bank` raises `BankValidationError`, whose message lists every failing row and
check at once (and whose `failure_cases` frame holds them), never only the first.
"""

from __future__ import annotations

import hashlib

import pandas as pd
import pandera.errors
import pandera.pandas as pa

from lopd_core.envs import SPLITS
from lopd_core.errors import StateError

CREATED_AT_DTYPE = pd.DatetimeTZDtype("us", "UTC")
ROW_ID_HEX = 32


def row_key(task_id: str, chain: str) -> str:
    """Content hash of an experience: same task instance + same chain = same row."""
    digest = hashlib.sha256(f"{task_id}\x1f{chain}".encode()).hexdigest()
    return digest[:ROW_ID_HEX]


def _non_empty():
    return pa.Check.str_length(min_value=1, error="empty string")


def _text_is_composed(df: pd.DataFrame) -> pd.Series:
    return df["experience_text"] == df["task_text"] + "\n" + df["chain"]


def _row_id_is_content_hash(df: pd.DataFrame) -> pd.Series:
    expected = [row_key(t, c) for t, c in zip(df["task_id"], df["chain"])]
    return pd.Series([a == b for a, b in zip(df["row_id"], expected)], index=df.index, dtype=bool)


_COMPOSED = "experience_text != task_text + '\\n' + chain"
_HASHED = "row_id is not the content hash of (task_id, chain)"
# Frame-wide row checks: pandera reports them once per column; keep one case, on the column that tells.
_ROW_CHECK_COLUMN = {_COMPOSED: "experience_text", _HASHED: "row_id"}

BANK_SCHEMA = pa.DataFrameSchema(
    {
        "row_id": pa.Column(str, pa.Check.str_matches(rf"^[0-9a-f]{{{ROW_ID_HEX}}}$"), unique=True),
        "task_id": pa.Column(str, _non_empty()),
        "env": pa.Column(str, _non_empty()),
        "split": pa.Column(str, pa.Check.isin(list(SPLITS))),
        "template": pa.Column(str, _non_empty()),
        "world": pa.Column(str, _non_empty()),
        "task_text": pa.Column(str, _non_empty()),  # the instruction; what the index embeds
        "chain": pa.Column(str, _non_empty()),  # "tool {args} -> observation" lines, then "answer: ..."
        "experience_text": pa.Column(str),  # task_text + "\n" + chain: what models read
        "reward": pa.Column(float, pa.Check.in_range(0.0, 1.0)),
        "policy_version": pa.Column(str, _non_empty()),
        "cycle": pa.Column(int, pa.Check.ge(0)),
        "created_at": pa.Column(CREATED_AT_DTYPE),
    },
    checks=[
        pa.Check(_text_is_composed, error=_COMPOSED),
        pa.Check(_row_id_is_content_hash, error=_HASHED),
    ],
    strict=True,
    coerce=False,
)

BANK_COLUMNS: tuple[str, ...] = tuple(BANK_SCHEMA.columns)


class BankValidationError(StateError, ValueError):
    """Rows rejected by the experience bank. `failure_cases` has one row per failure:
    index (the offending row's label in the input), column, check, failure_case. A StateError: the command line
    prints the list as it is, no traceback."""

    def __init__(self, failure_cases: pd.DataFrame, what: str = "experience bank rows"):
        cases = failure_cases.reset_index(drop=True).astype(object)
        self.failure_cases = cases
        rows = cases["index"].dropna().unique()
        lines = [f"{len(cases)} failure(s) in {len(rows)} of the {what}:"]
        for case in cases.itertuples(index=False):
            where = "frame" if pd.isna(case.index) else f"row {case.index}"
            column = "" if pd.isna(case.column) else f" column {case.column!r}"
            lines.append(f"  - {where}{column}: {case.check} (got {case.failure_case!r})")
        super().__init__("\n".join(lines))


def failure_frame(records: list[dict]) -> pd.DataFrame:
    """One row per failure; object columns, so row labels stay what they were (no int -> float for gaps)."""
    cols = ["index", "column", "check", "failure_case"]
    return pd.DataFrame({c: pd.Series([r.get(c) for r in records], dtype=object) for c in cols})


def _case_order(case: dict):
    index = case["index"]
    if index is None:
        return (0, 0, "")
    return (1, index, "") if isinstance(index, int) else (2, 0, str(index))


def sort_failures(cases: pd.DataFrame) -> pd.DataFrame:
    """Frame-level failures first, then by row (stable within a row)."""
    records = cases.to_dict("records")
    return failure_frame(sorted(records, key=_case_order))


def schema_failures(error: pandera.errors.SchemaErrors) -> pd.DataFrame:
    """pandera's failure cases reduced to index / column / check / failure_case, one per row and check."""
    records = []
    seen = set()
    for case in error.failure_cases.to_dict("records"):
        index = None if pd.isna(case.get("index")) else case.get("index")
        index = int(index) if isinstance(index, float) and index.is_integer() else index
        column = None if pd.isna(case.get("column")) else case.get("column")
        check = str(case.get("check"))
        primary = _ROW_CHECK_COLUMN.get(check)
        if primary is not None and index is not None:
            if column != primary or (index, check) in seen:
                continue
            seen.add((index, check))
        records.append({"index": index, "column": column, "check": check, "failure_case": case.get("failure_case")})
    return failure_frame(records)


def empty_bank_frame() -> pd.DataFrame:
    """A bank with no rows, with the schema's dtypes (what a missing bank file loads as)."""
    frame = pd.DataFrame({c: pd.Series([], dtype=str) for c in BANK_COLUMNS})
    frame["reward"] = frame["reward"].astype(float)
    frame["cycle"] = frame["cycle"].astype("int64")
    frame["created_at"] = pd.Series([], dtype=CREATED_AT_DTYPE)
    return frame


def validate_bank(frame: pd.DataFrame, what: str = "experience bank rows") -> pd.DataFrame:
    """Validate every row lazily; raise BankValidationError listing all failures."""
    try:
        return BANK_SCHEMA.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        raise BankValidationError(schema_failures(err), what) from err

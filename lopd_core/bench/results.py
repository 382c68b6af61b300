"""Verdicts, per-category scores, JSON-lines files and the merge into metrics/eval.json (all benchmarks).

metrics/eval.json belongs to several writers (`lopd evaluate`, `lopd bench ...` for each benchmark), so a
benchmark never rewrites the file: it reads it, replaces its own categories under its own top-level key
("bfcl", "acebench") and writes it back atomically. Scores are plain dicts of numbers and short strings, which
is what the evaluate flow logs to MLflow.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Verdict:
    """One test case: did the prediction pass, and if not, why (error_type is a short stable tag)."""

    valid: bool
    error: str = ""
    error_type: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


PASS = Verdict(True)


def fail(error_type: str, error: str) -> Verdict:
    return Verdict(False, error, error_type)


def accuracy_summary(verdicts: dict[str, Verdict]) -> dict:
    """{accuracy, correct, n} over the verdicts of one category (accuracy 0.0 when empty)."""
    n = len(verdicts)
    correct = sum(v.valid for v in verdicts.values())
    return {"accuracy": round(correct / n, 4) if n else 0.0, "correct": correct, "n": n}


def error_counts(verdicts: dict[str, Verdict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in verdicts.values():
        if not v.valid:
            counts[v.error_type] = counts.get(v.error_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def merge_metrics(path: str | Path, benchmark: str, scores: dict, *, under: str | None = None, finish=None) -> Path:
    """Read-modify-write metrics/eval.json: each key of `scores` replaces the same key of the benchmark's
    section (of `section[under]` when given, e.g. a language); `finish(section)` may then add summaries."""
    from lopd_core.outputs import file_target, write_file

    path = Path(path)
    current: dict = {}
    if file_target(path).exists():
        text = path.read_text()
        current = json.loads(text) if text.strip() else {}
        if not isinstance(current, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")
    section = current.get(benchmark)
    section = dict(section) if isinstance(section, dict) else {}
    target = section
    if under is not None:
        target = section[under] = dict(section[under]) if isinstance(section.get(under), dict) else {}
    target.update(scores)
    if finish is not None:
        finish(target)
    current[benchmark] = section
    write_file(path, json.dumps(current, indent=2, sort_keys=True, ensure_ascii=False))
    return path


def read_jsonl(path: str | Path, error: type[Exception] = ValueError) -> list[dict]:
    """The JSON objects of a JSON-lines file (blank lines skipped); `error` names the line that is not JSON."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise error(f"{path}:{number}: not JSON ({exc})") from None
    return rows


def write_jsonl(path: str | Path, rows) -> Path:
    """JSON lines written under the output-path rules (lopd_core/outputs.py): a FIFO, a device or a folder named
    as `--details` or a predictions file is refused in one line, never opened."""
    from lopd_core.outputs import write_file

    write_file(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return Path(path)


def write_details(path: str | Path, verdicts: dict[str, Verdict]) -> Path:
    """One JSON line per test case: id, valid, error_type, error (for reading failures, not for dashboards)."""
    return write_jsonl(path, ({"id": entry_id, **v.to_dict()} for entry_id, v in verdicts.items()))

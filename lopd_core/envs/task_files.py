"""Task files: an environment's tasks as JSON Lines, one JSON object per line.

A line names its split and instruction; every other key is the environment's own (the task's ``spec``):

    {"split": "train", "instruction": "Lend 'Dune' to Ada.", "state": {...}, "checks": [...]}

Optional keys: ``task_id`` (default ``<env>/<split>/<k>``, k = the line's rank among its split's lines),
``world`` (default the env's name: the bank retrieves within a world), ``template`` (default the env's name:
a grouping for reports) and ``max_turns`` (default the environment's). Blank lines and lines starting with
``#`` are skipped. A split is one of ``train``, ``val``, ``test_id``, ``test_ood``, ``pretrain_test``,
``test_final``; a file may hold any of them. Lines are parsed as JSON data, nothing in them is ever evaluated.

Drawing ``n`` tasks of a split (``tasks_from_file``): the split's tasks in a seeded order, so instance ``i``
depends only on (env, seed, split, i) and a larger ``n`` extends a smaller one. ``train`` repeats the file in
fresh seeded orders when ``n`` is larger than the file (the training stream needs its full length; a repeat is
the same task instance played again). The held-out splits never repeat: they return at most the file's tasks,
so an evaluation's ``n`` counts distinct tasks.

val and test_final are capped the same way, with a warning naming the env and both counts: a file is written by
hand and rarely holds the hundreds of tasks a built-in's default ``eval.n_per_split`` asks of them, and a short
split is still usable (its intervals say how little it measures), so the run goes on rather than failing there.
A file without a val or test_final line has no such split: an evaluation skips it, and a draw across the mix
(lopd_core/envs/mix.py ``deployment_tasks``) leaves the env out, with a warning.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from .base import MAX_TURNS, SPLITS, Task

TASK_KEYS = ("task_id", "split", "template", "world", "instruction", "max_turns")
CAPPED_WITH_WARNING = ("val", "test_final")  # the splits added after task files: capped with a warning (docstring)


class TaskFileError(ValueError):
    """A task file is missing or one of its lines is not a valid task (the message names file and line)."""


# How deep a task line's JSON may nest: far beyond any state or check a task needs, and shallow enough that
# nothing downstream (deep copies, the checks' walks, the bank's JSON) recurses out of its stack on it.
MAX_DEPTH = 64


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number that overflows a float (`1e999`) would enter as infinity: refused like NaN and Infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _data_error(value) -> str | None:
    """Why a parsed line is not plain data the pipeline can carry (None when it is): too deep, or a string that
    is not valid Unicode text (a lone surrogate from a `\\ud800` escape, which no tokenizer can encode)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if isinstance(node, dict):
            stack += [(k, depth) for k in node] + [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return f"the string {node[:40]!r} holds a lone surrogate (not valid Unicode text)"
    return None


def _parse_line(raw: bytes, where: str) -> dict | None:
    """One line of a task file as a JSON object (None for a blank or comment line); every way it can be bad is
    a TaskFileError naming `where` (file:line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFileError(
            f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); save the file as UTF-8"
        ) from None
    if not line.strip() or line.lstrip().startswith("#"):
        return None
    try:
        row = json.loads(line, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise TaskFileError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # NaN / Infinity, an integer of thousands of digits
        raise TaskFileError(f"{where}: not plain JSON data ({str(exc).splitlines()[0]})") from None
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
    why = _data_error(row)
    if why:
        raise TaskFileError(f"{where}: {why}")
    return row


@lru_cache(maxsize=32)
def _read_lines(path: str, mtime_ns: int, size: int) -> tuple[tuple[int, dict], ...]:
    rows = []
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TaskFileError(f"task file {path!r} cannot be read ({exc.strerror or exc})") from None
    for lineno, raw in enumerate(data.splitlines(), start=1):  # bytes: a bad byte is named by its line
        row = _parse_line(raw, f"{path}:{lineno}")
        if row is not None:
            rows.append((lineno, row))
    return tuple(rows)


def read_task_file(
    path: str | Path, env: str, *, max_turns: int = 8, validate_spec: Callable[[dict], str | None] | None = None
) -> dict[str, list[Task]]:
    """Every task of the file, by split in file order. ``validate_spec(spec)`` (the environment's) returns why
    a spec is unusable, or None; any bad line fails the whole file, naming the line."""
    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"task file {str(path)!r} of env {env!r} does not exist")
    stat = p.stat()
    by_split: dict[str, list[Task]] = {}
    seen: set[str] = set()
    for lineno, row in _read_lines(str(p.resolve()), stat.st_mtime_ns, stat.st_size):
        where = f"{path}:{lineno}"
        split, instruction = row.get("split"), row.get("instruction")
        if split not in SPLITS:
            raise TaskFileError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)}")
        if not isinstance(instruction, str) or not instruction.strip():
            raise TaskFileError(f"{where}: instruction must be a non-empty string")
        turns = row.get("max_turns", max_turns)
        if not isinstance(turns, int) or isinstance(turns, bool) or not 1 <= turns <= MAX_TURNS:
            raise TaskFileError(
                f"{where}: max_turns must be an integer in [1, {MAX_TURNS}] (base.MAX_TURNS says why), got {turns!r}"
            )
        for key in ("task_id", "world", "template"):
            if key in row and (not isinstance(row[key], str) or not row[key].strip()):
                raise TaskFileError(f"{where}: {key} must be a non-empty string")
        spec = {k: v for k, v in row.items() if k not in TASK_KEYS}
        why = validate_spec(spec) if validate_spec else None
        if why:
            raise TaskFileError(f"{where}: {why}")
        tasks = by_split.setdefault(split, [])
        task_id = row.get("task_id", f"{env}/{split}/{len(tasks):04d}")
        if task_id in seen:
            raise TaskFileError(f"{where}: task_id {task_id!r} appears twice")
        seen.add(task_id)
        tasks.append(
            Task(
                task_id=task_id,
                env=env,
                split=split,
                template=row.get("template", env),
                world=row.get("world", env),
                instruction=instruction,
                spec=spec,
                max_turns=turns,
            )
        )
    if not by_split:
        raise TaskFileError(f"task file {str(path)!r} of env {env!r} has no tasks")
    return by_split


def file_splits(path: str | Path, env: str, **kwargs) -> tuple[str, ...]:
    """The splits the file has tasks for, in the order of SPLITS."""
    by_split = read_task_file(path, env, **kwargs)
    return tuple(s for s in SPLITS if s in by_split)


def tasks_from_file(path: str | Path, env: str, split: str, n: int, seed: int, **kwargs) -> list[Task]:
    """``n`` tasks of ``split`` (held-out splits: at most the file's), in a seeded order (module docstring)."""
    pool = read_task_file(path, env, **kwargs).get(split, [])
    if not pool:
        raise TaskFileError(f"task file {str(path)!r} has no {split!r} tasks for env {env!r}")
    if split in CAPPED_WITH_WARNING and n > len(pool):
        warnings.warn(
            f"env {env!r}: its task file {str(path)!r} holds {len(pool)} {split!r} tasks, fewer than the {n} asked; "
            f"{split} takes the {len(pool)} it has (add {split} lines to the file for more)",
            stacklevel=2,
        )
    if split != "train":
        n = min(n, len(pool))
    out: list[Task] = []
    for rep in range(-(-n // len(pool))):
        order = list(pool)
        random.Random(f"{env}|{seed}|{split}|{rep}").shuffle(order)
        out += order
    return out[:n]

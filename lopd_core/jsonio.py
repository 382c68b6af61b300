"""The JSON files the pipeline keeps between runs (cycle history, champion, stage summaries): read with a default
where a first run finds none, written atomically so a crash or a concurrent reader never sees half a file.

Why one place: the flows and tasks each had their own copy of both, and only some of the writers were atomic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lopd_core.outputs import write_file


def read_json(path: str | Path | None, default: Any = None) -> Any:
    """The JSON value in `path`, or `default` when no path is given or nothing is there yet."""
    if not path or not Path(path).exists():
        return default
    return json.loads(Path(path).read_text())


def write_json(path: str | Path, value: Any, **dumps: Any) -> Path:
    """Write `value` as indented JSON to `path` atomically (outputs.write_file); `dumps` goes to json.dumps."""
    return write_file(path, json.dumps(value, **{"indent": 2, **dumps}))

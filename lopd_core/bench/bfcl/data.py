"""BFCL data: where it lives, which categories we score, and one `BfclEntry` per test case.

The data folder is a setting (`bench.bfcl_dir`); empty means the data shipped inside the `bfcl-eval` package
(`pip install --no-deps bfcl-eval==2026.3.23`; its declared pins would break this environment, so it is never a
declared dependency). The folder holds `BFCL_v4_<category>.json` (or the v3 files, same shape), one JSON object
per line, `possible_answer/` with the same file names, and `multi_turn_func_doc/` with the function documents of
the simulated APIs the multi-turn categories use (their entries carry no `function` field of their own).

Entries are joined to their answers by id (BFCL keeps both files in the same order, but ids are the contract).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from lopd_core.bench import results
from lopd_core.names import BFCL_CATEGORIES

# The names are the configuration's (lopd_core/names.py, a leaf bench.bfcl_categories is checked against).
CATEGORIES = BFCL_CATEGORIES  # single-turn, then multi-turn
SINGLE_TURN_CATEGORIES = tuple(c for c in CATEGORIES if not c.startswith("multi_turn_"))
MULTI_TURN_CATEGORIES = tuple(c for c in CATEGORIES if c.startswith("multi_turn_"))
# Categories whose answer is "no call" / "some call" rather than a specific call.
RELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance", "live_relevance")
# v4 renamed `simple` to `simple_python` (next to simple_java / simple_javascript, which we do not score).
_FILE_ALIASES = {"simple": ("simple_python", "simple")}

# Function documents of the simulated APIs, per class (file names as shipped in multi_turn_func_doc/).
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}

PACKAGE_HINT = "install it with `pip install --no-deps bfcl-eval==2026.3.23` or set bench.bfcl_dir"


class BfclDataError(FileNotFoundError):
    """The BFCL data folder or one of its files is missing or malformed."""


@dataclass
class BfclEntry:
    id: str
    category: str
    turns: list[list[dict]]  # the user messages of each turn (single-turn: one turn)
    functions: list[dict]  # function documents offered from the first turn
    answer: list | None  # single-turn: [{name: {param: [acceptable values]}}]; multi-turn: per turn, call strings
    initial_config: dict = field(default_factory=dict)
    involved_classes: list[str] = field(default_factory=list)
    added_functions: dict[int, list[dict]] = field(default_factory=dict)  # miss_func: turn -> documents added

    @property
    def multi_turn(self) -> bool:
        return self.category in MULTI_TURN_CATEGORIES


def package_data_dir() -> Path | None:
    """The data folder of the installed bfcl-eval package, found without importing it."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def resolve_data_dir(setting: str) -> Path:
    """`bench.bfcl_dir`, or the installed package's data when the setting is empty."""
    if setting:
        path = Path(setting)
        if not path.is_dir():
            raise BfclDataError(f"BFCL data folder {setting!r} (bench.bfcl_dir or --data-dir) is not a directory")
        return path
    path = package_data_dir()
    if path is None or not path.is_dir():
        raise BfclDataError(f"BFCL data not found: the bfcl-eval package is not installed ({PACKAGE_HINT})")
    return path


def check_category(category: str) -> str:
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; expected one of: {', '.join(CATEGORIES)}")
    return category


def _version(path: Path) -> int:
    match = re.match(r"BFCL_v(\d+)_", path.name)
    return int(match.group(1)) if match else -1


def category_file(data_dir: Path, category: str) -> Path:
    """The newest `BFCL_v<N>_<category>.json` in the folder (v3 and v4 share the format)."""
    check_category(category)
    for name in _FILE_ALIASES.get(category, (category,)):
        pattern = re.compile(rf"BFCL_v\d+_{re.escape(name)}\.json")
        found = sorted((p for p in data_dir.glob("BFCL_v*.json") if pattern.fullmatch(p.name)), key=_version)
        if found:
            return found[-1]
    raise BfclDataError(f"no BFCL file for category {category!r} in {data_dir} (expected BFCL_v4_{category}.json)")


def read_jsonl(path: Path) -> list[dict]:
    return results.read_jsonl(path, BfclDataError)


def multi_turn_docs(data_dir: Path, involved_classes: list[str]) -> list[dict]:
    docs = []
    for cls in involved_classes:
        if cls not in FUNC_DOC_FILES:
            raise BfclDataError(f"unknown simulated API class {cls!r}; known: {', '.join(FUNC_DOC_FILES)}")
        docs.extend(read_jsonl(data_dir / "multi_turn_func_doc" / FUNC_DOC_FILES[cls]))
    return docs


def _entry(row: dict, category: str, answer, data_dir: Path) -> BfclEntry:
    entry = BfclEntry(
        id=row["id"], category=category, turns=row["question"], functions=row.get("function", []), answer=answer
    )
    if entry.multi_turn:
        entry.initial_config = row.get("initial_config", {})
        entry.involved_classes = row["involved_classes"]
        docs = multi_turn_docs(data_dir, entry.involved_classes)
        held_out = {int(turn): names for turn, names in row.get("missed_function", {}).items()}
        held_names = {name for names in held_out.values() for name in names}
        entry.functions = [d for d in docs if d["name"] not in held_names]
        by_name = {d["name"]: d for d in docs}
        entry.added_functions = {turn: [by_name[n] for n in names] for turn, names in held_out.items()}
    return entry


def load_category(category: str, data_dir: Path, limit: int = 0) -> list[BfclEntry]:
    """Every entry of a category (the first `limit` when limit > 0), with its answer attached."""
    path = category_file(data_dir, category)
    rows = read_jsonl(path)
    if limit > 0:
        rows = rows[:limit]
    answers: dict[str, list] = {}
    if category not in RELEVANCE_CATEGORIES:
        answer_path = data_dir / "possible_answer" / path.name
        if not answer_path.exists():
            raise BfclDataError(f"missing answers for {category!r}: {answer_path}")
        answers = {a["id"]: a["ground_truth"] for a in read_jsonl(answer_path)}
        missing = [r["id"] for r in rows if r["id"] not in answers]
        if missing:
            raise BfclDataError(f"{answer_path}: no answer for {len(missing)} entries, e.g. {missing[0]!r}")
    return [_entry(r, category, answers.get(r["id"]), data_dir) for r in rows]

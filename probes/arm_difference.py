"""Two settings of one method, each a finished `lopd compare`, compared run by run with the compare's own verdicts.

    python probes/arm_difference.py data/compare_replay data/compare_plain [--method lopd_frozen_composer] \
        [--splits test_id pretrain_test] [--modes greedy sampled]

`lopd compare` decides between methods of one preset; a setting that is not a method (a replay share, a student
mode, a learning rate schedule) is compared by running the same preset twice, once per setting, each with its own
`compare.work_dir`, and reading both here. Runs pair by (world, seed): the same world, bank, φ and training seed,
so the same held-out tasks with the same sampling seeds, and the difference of each pair is one cell of the
two-level interval in lopd_core/compare/decide.py (a mixed model's two-stage analysis over seeds, floored at the
paired per-task variance). Prints one line per split and mode, and JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from lopd_core.compare.decide import compare_final
from tasks.caching import DONE


def finished_runs(work_dir: Path, method: str) -> list[dict]:
    """The final runs of `method` found in a comparison's work folder (those that finished)."""
    runs = [json.loads(p.read_text()) for p in sorted((work_dir / "runs").glob(f"final-*/{DONE}"))]
    return [r for r in runs if r["method"] == method]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="compare.work_dir of the setting tried")
    ap.add_argument("b", type=Path, help="compare.work_dir of the setting it is compared with")
    ap.add_argument("--method", default="lopd_frozen_composer")
    ap.add_argument("--splits", nargs="+", default=["test_id", "pretrain_test"])
    ap.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    a, b = finished_runs(args.a, args.method), finished_runs(args.b, args.method)
    print(f"{args.method}: {len(a)} runs in {args.a}, {len(b)} in {args.b}")
    out = []
    for split in args.splits:
        for mode in args.modes:
            d = compare_final(a, b, split, mode)
            means = [
                sum(r["final"][split][mode]["success_rate"] for r in runs) / max(len(runs), 1) * 100 for runs in (a, b)
            ]
            out.append({"split": split, "mode": mode, "a": means[0], "b": means[1], **asdict(d)})
            print(f"  {split:14s} {mode:8s} {means[0]:5.1f} vs {means[1]:5.1f} %: a − b {d.text()}")
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

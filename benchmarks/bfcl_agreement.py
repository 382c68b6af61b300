"""Our BFCL checker on BFCL's own data, and its agreement with BFCL's checker, case by case, per category.

For every test case: the ground-truth answer and each mutation (lopd_core/bench/bfcl/mutations.py) are
judged by our checker and by BFCL's (imported from the bfcl-eval package behind a stub module; multi-turn with
our eval-free executor in place of its `eval`). Per category it prints how many ground-truth answers we pass,
how many mutations we fail (those that should pass, parallel calls in another order, are among the rest), and
how often our verdict equals BFCL's; then a JSON summary. Needs `pip install --no-deps bfcl-eval==2026.3.23`.

    .venv/bin/python benchmarks/bfcl_agreement.py [--categories simple multi_turn_base ...] [--limit N]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.bench.bfcl.data import CATEGORIES, load_category, resolve_data_dir
from lopd_core.bench.bfcl.reference import compare, import_reference


def agreement(category: str, data_dir, limit: int = 0) -> dict:
    counts: Counter = Counter()
    disagreements = []
    for entry in load_category(category, data_dir, limit):
        for kind, ours, theirs in compare(entry, data_dir):
            counts["cases"] += 1
            if kind == "ground_truth":
                counts["entries"] += 1
                counts["ground_truth_pass"] += ours
            else:
                counts["mutations"] += 1
                counts["mutations_fail"] += not ours
            if theirs is None:
                counts["reference_error"] += 1
            elif ours == theirs:
                counts["agree"] += 1
            else:
                counts["ours_pass_bfcl_fail" if ours else "ours_fail_bfcl_pass"] += 1
                disagreements.append(f"{entry.id}:{kind}")
    judged = counts["cases"] - counts["reference_error"]
    return {
        "entries": counts["entries"],
        "ground_truth_pass": counts["ground_truth_pass"],
        "mutations": counts["mutations"],
        "mutations_fail": counts["mutations_fail"],
        "cases": counts["cases"],
        "agree": counts["agree"],
        "agreement": round(counts["agree"] / judged, 4) if judged else None,
        "ours_pass_bfcl_fail": counts["ours_pass_bfcl_fail"],
        "ours_fail_bfcl_pass": counts["ours_fail_bfcl_pass"],
        "reference_error": counts["reference_error"],
        "disagreements": disagreements[:10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--limit", type=int, default=0, help="test cases per category (0 = all)")
    parser.add_argument("--data-dir", default="", help="BFCL data folder (default: the bfcl-eval package's)")
    args = parser.parse_args()
    try:
        import_reference()
    except ImportError as exc:
        print(f"BFCL's checker cannot be imported ({exc}); install bfcl-eval with --no-deps", file=sys.stderr)
        return 1
    data_dir = resolve_data_dir(args.data_dir)
    table = {}
    print(
        f"{'category':<26}{'gt pass':>11}{'mutations failing':>19}{'cases':>7}{'agree':>7}{'rate':>8}"
        f"{'ours+ bfcl-':>13}{'ours- bfcl+':>13}{'bfcl err':>9}"
    )
    for category in args.categories:
        started = time.perf_counter()
        row = table[category] = agreement(category, data_dir, args.limit)
        row["seconds"] = round(time.perf_counter() - started, 1)
        gt, mutated = f"{row['ground_truth_pass']}/{row['entries']}", f"{row['mutations_fail']}/{row['mutations']}"
        print(
            f"{category:<26}{gt:>11}{mutated:>19}{row['cases']:>7}{row['agree']:>7}{row['agreement'] or 0:>8.4f}"
            f"{row['ours_pass_bfcl_fail']:>13}{row['ours_fail_bfcl_pass']:>13}{row['reference_error']:>9}"
        )
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

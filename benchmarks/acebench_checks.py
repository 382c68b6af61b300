"""Our ACEBench checker on ACEBench's data: the ground truth's pass rate per language and category.

Each answer in possible_answer/ is turned into the prediction a perfect model would make (the first
alternative's calls, or the sentence ACEBench's prompts ask for) and scored. The one failure is an answer that
leaves out a parameter its document requires (zh normal_atom_object_short_1). The mutation verdicts are in
tests/bench/test_acebench_ground_truth.py.

    .venv/bin/python benchmarks/acebench_checks.py [--data-dir ../shared/benchmarks/acebench]
"""

from __future__ import annotations

import argparse
import json
import sys

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.bench.acebench.data import CATEGORIES, LANGUAGES, load_category, resolve_data_dir
from lopd_core.bench.acebench.scoring import (
    category_scores,
    ground_truth_prediction,
    score_entries,
    unsatisfiable_ids,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/benchmarks/acebench", help="ACEBench data_all/ folder")
    args = parser.parse_args()
    data_dir = resolve_data_dir(args.data_dir)
    table: dict = {}
    print(f"{'language/category':<48}{'gt pass':>10}{'accuracy':>10}  unsatisfiable")
    for language in LANGUAGES:
        for category in CATEGORIES:
            entries = load_category(category, language, data_dir)
            verdicts = score_entries(entries, {e.id: ground_truth_prediction(e) for e in entries})
            scores = category_scores(entries, verdicts)
            passed = sum(v.valid for v in verdicts.values())
            table[f"{language}/{category}"] = {**scores, "unsatisfiable": unsatisfiable_ids(entries)}
            print(
                f"{language + '/' + category:<48}{f'{passed}/{len(entries)}':>10}{scores['accuracy']:>10.4f}  "
                f"{' '.join(unsatisfiable_ids(entries))}"
            )
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

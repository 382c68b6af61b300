"""Our BFCL checker against BFCL's own, case by case: ground truth and every mutation, per category.

BFCL's checker is imported from the bfcl-eval package behind a stub for its model-config module (see
lopd_core/bench/bfcl/reference.py); multi-turn runs its checking logic with our eval-free executor.
The one known disagreement is by design: BFCL matches parallel calls greedily, we use a maximum matching
(see test_bfcl_checker.test_parallel_matching_is_not_greedy). The table: benchmarks/bfcl_agreement.py.
"""

import pytest

from lopd_core.bench.bfcl.data import CATEGORIES, load_category, package_data_dir

DATA = package_data_dir()
pytestmark = pytest.mark.skipif(DATA is None or not DATA.is_dir(), reason="bfcl-eval is not installed")
SAMPLE = 10
KNOWN_DISAGREEMENTS = {"parallel_178:swapped_order"}  # greedy (BFCL) vs maximum matching (ours)


def disagreements(category: str, limit: int) -> tuple[list[str], int]:
    reference = pytest.importorskip("lopd_core.bench.bfcl.reference")
    try:
        reference.import_reference()
    except ImportError as exc:
        pytest.skip(f"BFCL's checker cannot be imported: {exc}")
    found, cases = [], 0
    for entry in load_category(category, DATA, limit):
        for kind, ours, theirs in reference.compare(entry, DATA):
            cases += 1
            if theirs is None or ours != theirs:
                found.append(f"{entry.id}:{kind}")
    return found, cases


@pytest.mark.parametrize("category", CATEGORIES)
def test_agreement_sample(category):
    found, cases = disagreements(category, SAMPLE)
    assert cases > 0
    assert set(found) <= KNOWN_DISAGREEMENTS, found


@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_agreement_full(category):
    found, cases = disagreements(category, 0)
    assert cases > 0
    assert set(found) <= KNOWN_DISAGREEMENTS, found

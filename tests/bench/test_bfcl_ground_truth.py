"""Evidence on BFCL's own data: ground truth passes, the mutation suite scores as BFCL's rules say.

Needs the bfcl-eval package's data (`pip install --no-deps bfcl-eval==2026.3.23`; scripts/setup.sh --dev does
it); skipped without it. The default tier takes the first SAMPLE test cases of each category; the slow tier
takes every one.
"""

import pytest

from lopd_core.bench.bfcl.answers import ground_truth_prediction, unsatisfiable_ids
from lopd_core.bench.bfcl.data import CATEGORIES, load_category, package_data_dir
from lopd_core.bench.bfcl.mutations import mutations
from lopd_core.bench.bfcl.scoring import score_entries, verdict_for

DATA = package_data_dir()
pytestmark = pytest.mark.skipif(DATA is None or not DATA.is_dir(), reason="bfcl-eval is not installed")
SAMPLE = 15
# Answers no call can meet under BFCL's rules (a required parameter without an acceptable value, or one the
# document does not declare). BFCL's own checker fails them too (test_bfcl_agreement).
UNSATISFIABLE = {
    "live_simple_106-63-0",
    "live_simple_112-68-0",
    "live_multiple_507-149-4",
    "live_multiple_862-181-3",
    "live_multiple_964-207-0",
}


def assert_ground_truth_passes(category: str, limit: int) -> None:
    entries = load_category(category, DATA, limit)
    verdicts = score_entries(entries, {e.id: ground_truth_prediction(e) for e in entries}, DATA)
    failed = {k for k, v in verdicts.items() if not v.valid}
    assert failed <= set(unsatisfiable_ids(entries)) & UNSATISFIABLE, {k: verdicts[k].error for k in failed}
    assert len(verdicts) == len(entries) > 0


def assert_mutations_score_by_the_rules(category: str, limit: int) -> None:
    wrong = []
    kinds = set()
    for entry in load_category(category, DATA, limit):
        for mutation in mutations(entry):
            kinds.add(mutation.kind)
            verdict = verdict_for(entry, mutation.prediction, DATA)
            if mutation.expected_valid is not None and verdict.valid != mutation.expected_valid:
                wrong.append((entry.id, mutation.kind, verdict.error))
    assert not wrong, wrong[:5]
    assert kinds


@pytest.mark.parametrize("category", CATEGORIES)
def test_ground_truth_passes_sample(category):
    assert_ground_truth_passes(category, SAMPLE)


@pytest.mark.parametrize("category", CATEGORIES)
def test_mutations_sample(category):
    assert_mutations_score_by_the_rules(category, SAMPLE)


def test_mutation_suite_covers_every_kind():
    kinds = {
        m.kind
        for c in ("parallel_multiple", "simple", "irrelevance", "live_relevance")
        for e in load_category(c, DATA, 5)
        for m in mutations(e)
    }
    assert {
        "wrong_function",
        "missing_required",
        "wrong_type",
        "wrong_value",
        "extra_call",
        "dropped_call",
        "swapped_order",
        "no_call",
    } <= kinds


def test_unsatisfiable_answers_are_exactly_the_known_ones():
    found = {i for c in ("live_simple", "live_multiple") for i in unsatisfiable_ids(load_category(c, DATA))}
    assert found == UNSATISFIABLE


@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_ground_truth_passes_full(category):
    assert_ground_truth_passes(category, 0)


@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_mutations_full(category):
    assert_mutations_score_by_the_rules(category, 0)

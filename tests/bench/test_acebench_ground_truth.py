"""Evidence on ACEBench's data: ground truth passes, mutations score as ACEBench's rules say.

Data: ../shared/benchmarks/acebench (relative to the project root; skipped when missing). The default tier
takes the first SAMPLE test cases (conversations, for multi-turn) of each category and language; the slow tier
all of them. Mutations and the verdict ACEBench's rules give them:
  wrong_function, missing_required, wrong_type, extra_call, dropped_call -> fail;  swapped_order -> pass;
  wrong_value: a string or list -> fail, but a number or boolean -> pass (ACEBench checks their type only);
  special: the expected sentence removed, or a call instead of text -> fail.
"""

from pathlib import Path

import pytest

from lopd_core.bench.acebench.checker import PY_TYPES, find_doc, normalize, parameter_schema
from lopd_core.bench.acebench.data import CATEGORIES, LANGUAGES, SPECIAL, load_category, resolve_data_dir
from lopd_core.bench.acebench.scoring import (
    category_scores,
    ground_truth_prediction,
    score_entries,
    unsatisfiable_ids,
    verdict_for,
)

ROOT = Path(__file__).resolve().parents[2]
DATA_SETTING = str(ROOT / ".." / "shared" / "benchmarks" / "acebench")
pytestmark = pytest.mark.skipif(not Path(DATA_SETTING).is_dir(), reason="ACEBench data not at ../shared")
SAMPLE = 10
UNSATISFIABLE = {("zh", "normal_atom_object_short_1")}  # its answer leaves out a required parameter
CASES = [(lang, cat) for lang in LANGUAGES for cat in CATEGORIES]


def entries(language, category, limit):
    return load_category(category, language, resolve_data_dir(DATA_SETTING), limit)


def assert_ground_truth_passes(language, category, limit):
    found = entries(language, category, limit)
    verdicts = score_entries(found, {e.id: ground_truth_prediction(e) for e in found})
    failed = {(language, k) for k, v in verdicts.items() if not v.valid}
    assert failed <= UNSATISFIABLE, {k: verdicts[k].error for _, k in failed}
    assert {(language, i) for i in unsatisfiable_ids(found)} == failed
    scores = category_scores(found, verdicts)
    assert scores["n"] == len(found) > 0


def _swap_type(value, type_name):
    return {
        "string": 12345,
        "integer": f"{value}",
        "number": f"{value}",
        "boolean": "yes",
        "array": "x",
        "object": "x",
    }.get(type_name)


def _other_value(value):
    """(new value, verdict ACEBench gives it)."""
    if isinstance(value, (bool, int, float)):
        return (not value if isinstance(value, bool) else value + 1000), True
    if isinstance(value, str) and normalize(value):
        return "zqzq", False
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ["zqzq", *value[1:]], False
    return None, None


def mutations(entry):
    gt = ground_truth_prediction(entry)
    if entry.category in SPECIAL:
        return [
            ("no_sentence", {"id": entry.id, "text": "I am not sure."}, False),
            ("call_instead", {"id": entry.id, "text": "[some_api(x=1)]"}, False),
        ]
    calls = gt["calls"]
    first = calls[0]
    out = [
        ("wrong_function", {**gt, "calls": [{**first, "name": first["name"] + "_zz"}, *calls[1:]]}, False),
        ("extra_call", {**gt, "calls": [*calls, first]}, False),
    ]
    if len(calls) > 1:
        out += [
            ("dropped_call", {**gt, "calls": calls[:-1]}, False),
            ("swapped_order", {**gt, "calls": calls[::-1]}, True),
        ]
    doc = find_doc(entry.functions, first["name"]) or {}
    schema = parameter_schema(doc)
    required = [p for p in schema.get("required", []) if p in first["arguments"]]
    alone = sum(c["name"] == first["name"] for c in calls) == 1  # else a sibling call may stand in for it
    if required and alone:
        args = {k: v for k, v in first["arguments"].items() if k != required[0]}
        out.append(("missing_required", {**gt, "calls": [{**first, "arguments": args}, *calls[1:]]}, False))
    for param, value in first["arguments"].items():
        type_name = schema.get("properties", {}).get(param, {}).get("type")
        if type_name not in PY_TYPES or type(value) is not PY_TYPES[type_name] or len(calls) > 1:
            continue  # only where the answer has the document's type (else ACEBench checks the answer's type)
        for kind, (new, expected) in (
            ("wrong_type", (_swap_type(value, type_name), False)),
            ("wrong_value", _other_value(value)),
        ):
            if new is not None:
                args = {**first["arguments"], param: new}
                out.append((kind, {**gt, "calls": [{**first, "arguments": args}]}, expected))
        break
    return out


def assert_mutations(language, category, limit):
    wrong, kinds = [], set()
    for entry in entries(language, category, limit):
        if (language, entry.id) in UNSATISFIABLE:
            continue
        for kind, record, expected in mutations(entry):
            kinds.add(kind)
            verdict = verdict_for(entry, record)
            if verdict.valid != expected:
                wrong.append((entry.id, kind, verdict.error))
    assert not wrong, wrong[:5]
    return kinds


@pytest.mark.parametrize("language,category", CASES)
def test_ground_truth_passes_sample(language, category):
    assert_ground_truth_passes(language, category, SAMPLE)


@pytest.mark.parametrize("language,category", CASES)
def test_mutations_sample(language, category):
    assert_mutations(language, category, SAMPLE)


def test_mutations_cover_every_kind():
    kinds = set()
    for category in (
        "normal_single_turn_parallel_function",
        "normal_atom_number",
        "normal_atom_bool",
        "normal_atom_list",
        "special_incomplete",
    ):
        kinds |= assert_mutations("en", category, 5)
    assert {
        "wrong_function",
        "missing_required",
        "wrong_type",
        "wrong_value",
        "extra_call",
        "dropped_call",
        "swapped_order",
        "no_sentence",
    } <= kinds


@pytest.mark.slow
@pytest.mark.parametrize("language,category", CASES)
def test_ground_truth_passes_full(language, category):
    assert_ground_truth_passes(language, category, 0)


@pytest.mark.slow
@pytest.mark.parametrize("language,category", CASES)
def test_mutations_full(language, category):
    assert_mutations(language, category, 0)

"""Our BFCL single-turn checker on hand-made cases, one rule at a time (no package data needed)."""

from lopd_core.bench.bfcl.checker import check_call, check_single_turn, normalize
from lopd_core.bench.tool_calls import ToolCall

DOC = {
    "name": "book",
    "parameters": {
        "type": "dict",
        "required": ["city", "nights"],
        "properties": {
            "city": {"type": "string"},
            "nights": {"type": "integer"},
            "price": {"type": "float"},
            "pets": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "room": {"type": "dict"},
            "guests": {"type": "array", "items": {"type": "dict"}},
        },
    },
}
ANSWER = {
    "book": {
        "city": ["Paris", "paris, france"],
        "nights": [2],
        "price": [99.5, ""],
        "pets": [False, ""],
        "tags": [["Quiet", "sea view"], ""],
        "room": [{"kind": ["double"], "floor": [2, ""]}, ""],
        "guests": [[{"name": ["Ann"]}, {"name": ["Bo"]}], ""],
    }
}


def check(**arguments):
    return check_call(DOC, ToolCall("book", arguments), ANSWER)


def test_required_only_and_optional_marker():
    assert check(city="Paris", nights=2).valid  # every other parameter is optional ("" acceptable)


def test_string_normalization():
    assert normalize("Paris, France") == "parisfrance"
    assert check(city="PARIS, france", nights=2).valid
    assert not check(city="Lyon", nights=2).valid


def test_int_accepted_for_float_but_not_the_reverse():
    assert check(city="Paris", nights=2, price=99.5).valid
    assert check_call(
        DOC,
        ToolCall("book", {"city": "Paris", "nights": 2, "price": 100}),
        {"book": {**ANSWER["book"], "price": [100.0]}},
    ).valid
    assert check(city="Paris", nights=2.0).error_type == "type_error"


def test_bool_is_not_an_int():
    assert check(city="Paris", nights=True).error_type == "type_error"
    assert check(city="Paris", nights=2, pets="false").error_type == "type_error"


def test_lists_dicts_and_lists_of_dicts():
    assert check(city="Paris", nights=2, tags=["quiet", "Sea-View"]).valid
    assert not check(city="Paris", nights=2, tags=["sea view", "quiet"]).valid  # list order matters
    assert check(city="Paris", nights=2, room={"kind": "Double"}).valid  # floor is optional inside the dict
    assert not check(city="Paris", nights=2, room={"kind": "double", "view": "sea"}).valid
    assert check(city="Paris", nights=2, guests=[{"name": "ann"}, {"name": "Bo"}]).valid
    assert not check(city="Paris", nights=2, guests=[{"name": "Bo"}, {"name": "Ann"}]).valid


def test_name_required_unexpected_and_missing_optional():
    assert check_call(DOC, ToolCall("Book", {"city": "Paris", "nights": 2}), ANSWER).error_type == "wrong_func_name"
    assert check(city="Paris").error_type == "missing_required"
    assert check(city="Paris", nights=2, color="red").error_type == "unexpected_param"
    strict = {"book": {**ANSWER["book"], "pets": [True]}}  # no "" -> the answer demands it
    assert check_call(DOC, ToolCall("book", {"city": "Paris", "nights": 2}), strict).error_type == "missing_optional"


def test_parallel_any_order_and_counts():
    functions = [DOC]
    answer = [{"book": {"city": ["Paris"], "nights": [2]}}, {"book": {"city": ["Rome"], "nights": [3]}}]
    paris, rome = ToolCall("book", {"city": "Paris", "nights": 2}), ToolCall("book", {"city": "Rome", "nights": 3})
    assert check_single_turn("parallel", functions, [rome, paris], answer).valid
    assert check_single_turn("parallel", functions, [paris], answer).error_type == "wrong_count"
    assert check_single_turn("parallel", functions, [paris, paris], answer).error_type == "no_match"


def test_parallel_matching_is_not_greedy():
    # The first expected call accepts either city; BFCL's greedy matching gives it the first fitting call
    # (Rome) and then cannot place the second. Any order should pass: a maximum matching finds it.
    functions = [DOC]
    answer = [{"book": {"city": ["Paris", "Rome"], "nights": [2]}}, {"book": {"city": ["Rome"], "nights": [2]}}]
    calls = [ToolCall("book", {"city": "Rome", "nights": 2}), ToolCall("book", {"city": "Paris", "nights": 2})]
    assert check_single_turn("parallel", functions, calls, answer).valid


def test_simple_and_multiple_take_exactly_one_call():
    other = {"name": "cancel", "parameters": {"type": "dict", "required": [], "properties": {}}}
    call = ToolCall("book", {"city": "Paris", "nights": 2})
    assert check_single_turn("multiple", [other, DOC], [call], [ANSWER]).valid
    assert check_single_turn("simple", [DOC], [call, call], [ANSWER]).error_type == "wrong_count"


def test_relevance_categories():
    call = [ToolCall("book", {})]
    assert check_single_turn("irrelevance", [DOC], [], None).valid
    assert not check_single_turn("live_irrelevance", [DOC], call, None).valid
    assert check_single_turn("live_relevance", [DOC], call, None).valid
    assert not check_single_turn("live_relevance", [DOC], [], None).valid

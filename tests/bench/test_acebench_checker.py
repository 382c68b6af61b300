"""Our ACEBench checker on hand-made cases: each rule, including the ones where ACEBench is lenient."""

from lopd_core.bench.acebench.checker import base_name, check_normal, check_special
from lopd_core.bench.tool_calls import ToolCall

DOC = {
    "name": "plan_trip",
    "parameters": {
        "type": "object",
        "required": ["city"],
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "budget": {"type": "number"},
            "pets": {"type": "boolean"},
            "stops": {"type": "array", "items": {"type": "string"}},
            "notes": {"type": "array"},
            "hotel": {"type": "object", "properties": {"name": {"type": "string"}, "stars": {"type": "integer"}}},
            "legs": {"type": "array", "items": {"type": "object"}},
        },
    },
}
ANSWER = {
    "plan_trip": {
        "city": "Paris",
        "days": 3,
        "budget": 1200.5,
        "pets": True,
        "stops": ["Lyon", "Dijon"],
        "notes": ["quiet"],
        "hotel": {"name": "Ritz", "stars": 5},
        "legs": [{"from": "Paris", "to": "Lyon"}],
    }
}


def check(answer=ANSWER, **arguments):
    return check_normal([DOC], [ToolCall("plan_trip", arguments)], answer)


def test_the_answer_itself_passes():
    assert check(**ANSWER["plan_trip"]).valid


def test_strings_pass_by_containment_after_normalization():
    assert check(city="paris, france").valid  # ACEBench: the answer contained in the value
    assert not check(city="Lyon").valid


def test_numbers_and_booleans_are_type_checked_only():
    assert check(city="Paris", days=30, pets=False).valid  # a wrong value passes: ACEBench's rule
    assert check(city="Paris", days="3").error_type == "type_error"
    assert check(city="Paris", pets="true").valid  # ACEBench reads the string "true" as a boolean
    assert check(city="Paris", pets="yes").error_type == "type_error"


def test_lists_objects_and_lists_of_objects():
    assert check(city="Paris", stops=["lyon", "DIJON"]).valid
    assert not check(city="Paris", stops=["Dijon", "Lyon"]).valid
    assert check(city="Paris", notes=["Quiet"]).valid  # an array without item type, with string items
    assert check(city="Paris", hotel={"name": "The Ritz Paris", "stars": 5}).valid
    assert not check(city="Paris", hotel={"name": "Ritz"}).valid  # same keys as the answer, no fewer
    assert check(city="Paris", legs=[{"from": "Paris", "to": "Lyon"}]).valid
    assert not check(city="Paris", legs=[{"from": "Paris", "to": "Nice"}]).valid


def test_empty_answer_lists_pass():
    answer = {"plan_trip": {"city": "Paris", "legs": []}}
    assert check(answer, city="Paris", legs=[]).valid


def test_required_extra_and_names():
    assert check(days=3).error_type == "lack_args"
    assert check(city="Paris", color="red").error_type == "addition_args"
    assert check_normal([DOC], [ToolCall("plan", {"city": "Paris"})], ANSWER).error_type == "function_mismatch"
    assert check_normal([DOC], [], ANSWER).error_type == "wrong_count"


def test_repeated_calls_and_suffixes():
    answer = {"plan_trip_1": {"city": "Paris"}, "plan_trip_2": {"city": "Rome"}}
    rome, paris = ToolCall("plan_trip", {"city": "Rome"}), ToolCall("plan_trip", {"city": "Paris"})
    assert check_normal([DOC], [rome, paris], answer).valid  # any order
    assert not check_normal([DOC], [paris, paris], answer).valid
    suffixed = {**DOC, "name": "plan_trip_2"}
    assert base_name("plan_trip_2", [DOC]) == "plan_trip"
    assert base_name("plan_trip_2", [suffixed]) == "plan_trip_2"  # a function whose own name ends in _2


def test_alternative_answers():
    assert check([{"plan_trip": {"city": "Rome"}}, {"plan_trip": {"city": "Paris"}}], city="Paris").valid


def test_special_answers():
    assert check_special("special_irrelevant", "Due to the limitations of the function, I cannot solve this.", "").valid
    incomplete = {"plan_trip": ["city", "days"]}
    assert check_special(
        "special_incomplete", "Missing necessary parameters (city, days) for the api (plan_trip)", incomplete
    ).valid
    assert (
        check_special("special_incomplete", "Missing necessary parameters (city)", incomplete).error_type
        == "error_correction"
    )
    assert check_special("special_incomplete", "[plan_trip(city='x')]", incomplete).error_type == "error_detection"
    wrong = {"date": ["31-02-2024"]}
    assert check_special(
        "special_error_param", "There is incorrect value (31-02-2024) for the parameters (date)", wrong
    ).valid
    assert not check_special("special_error_param", "There is incorrect value (x)", wrong).valid

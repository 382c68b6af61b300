"""The call parser: Python and JSON tool-call syntax, literal values only, nothing ever runs."""

import pytest

from lopd_core.bench.tool_calls import (
    CallParseError,
    ToolCall,
    calls_or_none,
    parse_call_string,
    parse_calls,
)


def test_python_list_of_calls_with_literals():
    calls = parse_calls("[get_weather(city='Paris', days=3, units=None), math.hypot(x=-4, y=5.5, tags=['a', 'b'])]")
    assert calls == [
        ToolCall("get_weather", {"city": "Paris", "days": 3, "units": None}),
        ToolCall("math.hypot", {"x": -4, "y": 5.5, "tags": ["a", "b"]}),
    ]


def test_bare_call_fences_and_empty_list():
    assert parse_calls("```python\nf(a={'k': (1, 2)})\n```") == [ToolCall("f", {"a": {"k": (1, 2)}})]
    assert parse_calls("[]") == []


def test_arithmetic_is_folded_not_evaluated():
    assert parse_calls("f(x=2*3+1, y=2**10, z=-(4))")[0].arguments == {"x": 7, "y": 1024, "z": -4}
    with pytest.raises(CallParseError):
        parse_calls("f(x=10**10**10)")  # exponent capped: no runaway computation
    with pytest.raises(CallParseError):
        parse_calls("f(x='a'*3)")  # arithmetic on non-numbers is not a literal


def test_code_in_arguments_is_kept_as_text_never_run():
    call = parse_calls("f(path=__import__('os').getcwd(), fn=lambda: 1, var=some_name)")[0]
    assert call.arguments == {"path": "__import__('os').getcwd()", "fn": "lambda: 1", "var": "some_name"}


def test_nested_call_with_keywords_becomes_a_dict():
    assert parse_calls("f(x=g(a=1))")[0].arguments == {"x": {"g": {"a": 1}}}


def test_positional_arguments_are_kept_apart():
    call = parse_call_string("sort('final_report.pdf')")
    assert call == ToolCall("sort", {}, ("final_report.pdf",))
    assert call.python_source() == "sort('final_report.pdf')"


def test_json_tool_call_blocks_and_objects():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    )
    assert parse_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]})]
    assert parse_calls('[{"name": "a", "parameters": {"x": 1}}]') == [ToolCall("a", {"x": 1})]
    assert parse_calls('{"type": "function", "function": {"name": "a", "arguments": {}}}') == [ToolCall("a", {})]


def test_prose_holds_no_call():
    assert calls_or_none("I cannot help with that: none of the functions fits.") == []
    with pytest.raises(CallParseError):
        parse_calls("Sure! Here you go.")

"""The contract checker calls every declared tool (issue #30 item 10): an environment whose tools raise inside,
or keep state outside the episode, fails the check naming the tool; a ToolSpec whose schema names another
parameter than its function fails when the class is defined; tool bugs a rollout meets are warned about once per
tool."""

import warnings
from types import SimpleNamespace
from typing import ClassVar

import pytest
from _plugin_fixture import CounterEnv, add_note

from lopd_cli.main import main
from lopd_core.envs import check_env_contract, format_call, guarded, make_env, make_tasks, registry
from lopd_core.envs.contract import schema_arguments
from lopd_core.envs.declarative import DeclarativeToolEnv, ToolError, ToolSpec, tool_table


@pytest.fixture(autouse=True)
def clean_registry():
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def use(**plugins):
    registry.use_config(SimpleNamespace(plugins={k: f"_plugin_fixture:{v}" for k, v in plugins.items()}, task_files={}))


def check(name: str, n: int = 2) -> int:
    return check_env_contract(lambda: make_env(name), make_tasks(name, "train", n, 0))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_an_env_whose_every_tool_raises_fails_the_check_naming_the_tool():
    use(broken_tools="BrokenToolsEnv")
    with pytest.raises(AssertionError, match=r"a tool raised inside \(broken_add: KeyError\('no such key'\)\)"):
        check("broken_tools")


def test_a_tool_that_keeps_state_outside_the_episode_fails_the_check():
    use(global_state="GlobalStateEnv")
    with pytest.raises(
        AssertionError,
        match=r"tool ticket answered '\{\"result\": \d+\}', then '\{\"result\": \d+\}'"
        r" in a fresh instance .* keep state outside the episode",
    ):
        check("global_state")


def test_a_toolspec_whose_schema_names_another_parameter_fails_when_the_class_is_defined():
    schema = {
        "name": "find",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }
    with pytest.raises(
        TypeError,
        match=r"tool find: the schema declares parameter 'query', which its function "
        r"<lambda>\(state, title\) does not take",
    ):
        tool_table([ToolSpec(schema, lambda state, title: title)])
    with pytest.raises(TypeError, match="tool find: the schema declares parameter 'query'"):
        tools = (ToolSpec(schema, lambda state, title: 0),)
        type("Mismatched", (DeclarativeToolEnv,), {"name": "mismatched", "tools": tools})
    optional = {**schema, "parameters": {**schema["parameters"], "required": []}}
    with pytest.raises(TypeError, match="tool find: its function needs 'query', which the schema does not require"):
        tool_table([ToolSpec(optional, lambda state, query: query)])
    with pytest.raises(TypeError, match="first positional parameter"):
        tool_table([ToolSpec(schema, lambda *, query: query)])
    # what fits: the parameters agree, optional ones have defaults, or the function takes **kwargs
    tool_table(
        [
            ToolSpec(schema, lambda state, query, limit=3: query),
            ToolSpec({**schema, "name": "g"}, lambda state, **kw: kw),
        ]
    )


def _strict_lookup(state: dict, book: str) -> str:
    if book not in ("b1", "b2"):
        raise KeyError(book)  # a bug for an unknown id (should be ToolError), never met with the class's examples
    return book


LOOKUP = ToolSpec(
    {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"book": {"type": "string"}}, "required": ["book"]},
    },
    _strict_lookup,
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_tool_examples_are_what_the_checker_calls_and_are_checked_at_class_definition():
    class Lookup(CounterEnv):
        name = "lookup_env"
        tools = (add_note, LOOKUP)

    class LookupWithExamples(Lookup):
        tool_examples: ClassVar[dict] = {"lookup": [{"book": "b1"}, {"book": "b2"}]}

    tasks = CounterEnv.make_tasks("train", 1, 0)
    tasks = [t.__class__(**{**t.__dict__, "env": "lookup_env"}) for t in tasks]
    assert schema_arguments(LOOKUP.schema) == {"book": "a"}
    with pytest.raises(AssertionError, match=r"a tool raised inside \(lookup: KeyError\('a'\)\)"):
        check_env_contract(Lookup, tasks)
    assert check_env_contract(LookupWithExamples, tasks) == 1
    with pytest.raises(TypeError, match=r"tool_examples\['lookup'\]\[0\]: missing argument: book"):
        type("Bad", (Lookup,), {"tool_examples": {"lookup": [{}]}})
    with pytest.raises(TypeError, match="tool_examples names 'nope', which is not a declared tool"):
        type("Bad", (Lookup,), {"tool_examples": {"nope": [{}]}})


def test_a_rollout_that_meets_a_tool_bug_warns_once_naming_the_tool(monkeypatch):
    monkeypatch.setattr(guarded, "_warned", set())
    use(broken_tools="BrokenToolsEnv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for task in make_tasks("broken_tools", "train", 3, 0):  # three episodes, the same bug in each
            env = make_env(task)  # the door the rollout engine builds its environments through
            env.reset(task)
            r = env.step(format_call("broken_add", {"title": "a"}))
            assert r.info["error"] == "failed" and len(env.internal_errors) == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert messages[0].startswith("env 'broken_tools': tool 'broken_add' raised inside (KeyError('no such key'))")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_envs_check_reports_tool_bugs(capsys):
    assert (
        main(
            [
                "envs",
                "check",
                "broken_tools",
                "--n",
                "1",
                "--set",
                "envs.plugins={broken_tools: '_plugin_fixture:BrokenToolsEnv'}",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "FAIL broken_tools train: [env contract] task broken_tools/train/0/0: a tool raised "
        "inside (broken_add: KeyError('no such key'))"
    )


def test_a_tool_error_is_not_a_bug():
    """A tool that refuses a made-up argument with ToolError is doing its job: the example library passes."""

    def strict(state: dict, book: str) -> str:
        """Look a book up.

        Args:
            book: its id
        """
        raise ToolError("no such book")

    class Strict(CounterEnv):
        name = "strict_env"
        tools = (strict,)

    tasks = [t.__class__(**{**t.__dict__, "env": "strict_env"}) for t in CounterEnv.make_tasks("train", 1, 0)]
    assert check_env_contract(Strict, tasks) == 1

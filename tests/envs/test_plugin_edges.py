"""Plugin edges of issue #30 item 15 and item 12: NaN and Infinity are no numbers to a tool or in an observation,
two installed packages claiming one environment name are refused naming both, and a plugin that exits while
imported is an error, not a silent exit."""

import json
import math
from types import SimpleNamespace

import pytest

from lopd_core import config as config_mod
from lopd_core.config import ConfigError, EnvsConfig
from lopd_core.envs import Task, make_env, registry
from lopd_core.envs.declarative import DeclarativeToolEnv
from lopd_core.envs.toolworld.tools import observation_text, parse_action


@pytest.fixture(autouse=True)
def clean_registry():
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))
    config_mod._installed_env_plugins.cache_clear()


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_as_tool_arguments(constant):
    kind, message, _ = parse_action(f'<tool_call>{{"name": "pay", "arguments": {{"amount": {constant}}}}}</tool_call>')
    assert kind == "error" and "NaN and Infinity are not JSON numbers" in message


def _strict_json(text: str):
    """JSON as the standard has it (python's json would read a bare NaN or Infinity)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text!r}"))


def ratio(state: dict, x: float) -> float:
    """A tool whose result may be NaN."""
    return x / x if x == 0 else float("inf") if x < 0 else x


class RatioEnv(DeclarativeToolEnv):
    name = "ratio"
    tools = (ratio,)


def test_a_non_finite_tool_result_never_reaches_an_observation_as_bare_nan():
    task = Task(
        task_id="r/0",
        env="ratio",
        split="train",
        template="t",
        world="ratio",
        instruction="Divide.",
        spec={"state": {}, "checks": [{"op": "answer_eq", "value": "1"}]},
        max_turns=3,
    )
    env = RatioEnv()
    env.reset(task)
    result = env.step('<tool_call>{"name": "ratio", "arguments": {"x": -1}}</tool_call>')
    assert _strict_json(result.observation)["error"].startswith("failed")
    assert env.internal_errors and "not JSON" in env.internal_errors[0]
    text = observation_text({"result": [math.nan, {"a": math.inf}]})
    assert _strict_json(text) == {"result": ["NaN", {"a": "Infinity"}]}


def _dist_info(root, package: str, value: str) -> None:
    info = root / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[lopd.envs]\nnotes = {value}\n")


def test_two_packages_registering_one_name_are_refused_naming_both(tmp_path, monkeypatch):
    _dist_info(tmp_path, "notes_a", "_plugin_fixture:NotesEnv")
    _dist_info(tmp_path, "notes_b", "other_pkg:NotesEnv")
    monkeypatch.syspath_prepend(str(tmp_path))
    config_mod._installed_env_plugins.cache_clear()
    with pytest.raises(ConfigError) as caught:
        EnvsConfig(mix={"notes": 1.0})
    message = str(caught.value)
    assert "notes_a (_plugin_fixture:NotesEnv)" in message and "notes_b (other_pkg:NotesEnv)" in message
    assert "envs.plugins" in message
    with pytest.raises(ValueError, match="registered by more than one installed package"):
        make_env("notes")
    # naming one in envs.plugins settles it
    EnvsConfig(mix={"notes": 1.0}, plugins={"notes": "_plugin_fixture:NotesEnv"})
    registry.use_config(SimpleNamespace(plugins={"notes": "_plugin_fixture:NotesEnv"}, task_files={}))
    assert type(make_env("notes")).__name__ in ("NotesEnv", "TimedEnv")


def test_a_plugin_that_exits_while_imported_is_an_import_error(tmp_path, monkeypatch):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.use_config(SimpleNamespace(plugins={"exits": "exits_at_import:Env"}, task_files={}))
    with pytest.raises(ImportError, match=r"called sys.exit\(3\) while being imported"):
        registry.env_class("exits")

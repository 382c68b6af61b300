"""Every environment keeps the shared contract (lopd_core/envs/contract.py): one test over the built-ins and the
example plugin, each built the way the trainer builds it (`make_env`, so the plugin sits behind its guard).

Each environment is played by its own oracle, so the determinism and episode-record checks see an episode that
is won, and, where an answer ends its episodes, also by the checker's default script (a malformed call, then an
answer). Codegen is the exception: an answer that fails its tests is feedback and the episode goes on.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _plugin_fixture import solve_library
from _toolworld_fixtures import tasks as toolworld_tasks

from lopd_core.envs import ENVS, check_env_contract, make_env, make_tasks, registry, run_oracle
from lopd_core.envs.codegen import oracle_action


def _toolworld():
    sample = {}
    for t in (t for split in registry.env_splits("toolworld") for t in toolworld_tasks(split)):
        sample.setdefault((t.template, t.split), t)  # one task per template and split
    tasks = list(sample.values())
    assert len(tasks) >= 48 and len({t.world for t in tasks}) > 1
    return tasks, lambda task: run_oracle(task)[0], True


def _codegen():
    tasks = [t for split in registry.env_splits("codegen") for t in make_tasks("codegen", split, 1, 0)]
    return tasks, lambda task: [oracle_action(task)], False


def _library():
    pytest.importorskip("lopd_example_env", reason="install examples/lopd-example-env (setup.sh --dev)")
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))  # found through its entry point
    tasks = [t for split in registry.env_splits("library") for t in make_tasks("library", split, 100, 0)]
    return tasks, solve_library, True


CASES = {"toolworld": _toolworld, "codegen": _codegen, "library": _library}


def test_every_built_in_environment_has_a_case():
    assert set(ENVS) <= set(CASES)


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_environment_keeps_the_contract(name):
    tasks, oracle, an_answer_ends_it = CASES[name]()
    assert {t.env for t in tasks} == {name}
    assert {t.split for t in tasks} == set(registry.env_splits(name))
    assert check_env_contract(lambda: make_env(name), tasks, scripted=oracle) == len(tasks)
    if an_answer_ends_it:
        assert check_env_contract(lambda: make_env(name), tasks) == len(tasks)

"""Which environments exist, how to build one by name, and where its tasks come from.

An environment is any class whose instances pass the contract checker (contract.py): ``name``, ``reset(task)``,
``step(action)``, ``episode``. A name resolves, in this order, to

1. a built-in: ``toolworld``, ``codegen`` (the only ones with pretraining worlds and an oracle);
2. ``envs.plugins`` of the run's params, name -> ``"module:Class"``;
3. an entry point of group ``lopd.envs`` that an installed package declares (value ``module:Class``).

The class's ``name`` must equal the name it is registered under: a task carries only that name, and the
rollout engine rebuilds the environment from it. A plugin's tasks come from ``envs.task_files[name]`` (a JSON
Lines file, task_files.py) when set, else from the class's own ``make_tasks(split, n, seed)``. Its splits are
the file's, else the class's ``splits`` attribute, else train / test_id / test_ood (a plugin has no pretraining
worlds, so no ``pretrain_test`` unless it provides one).

Why a process-wide table for the params part: the rollout engine builds environments from a task's env name
alone. Every door that draws tasks from a run's ``envs:`` section (mix.py, evaluation.py, ``lopd envs check``)
calls ``use_config`` first, so the names its tasks carry resolve. Module paths come from configuration and
package metadata, never from model output.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from lopd_core.config import installed_env_plugins
from lopd_core.names import BUILTIN_ENVS, ENV_ENTRY_POINT_GROUP

from .base import SPLITS, Task
from .task_files import file_splits, tasks_from_file

PLUGIN_SPLITS = ("train", "test_id", "test_ood")

_plugins: dict[str, str] = {}  # envs.plugins of the run this process serves
_task_files: dict[str, str] = {}  # envs.task_files of that run


def use_config(envs) -> None:
    """Make an ``envs:`` config section's plugins and task files this process's (replacing earlier ones)."""
    global _plugins, _task_files
    _plugins = dict(getattr(envs, "plugins", {}) or {})
    _task_files = dict(getattr(envs, "task_files", {}) or {})


def installed() -> dict[str, str]:
    """Entry points of group ``lopd.envs``: name -> ``module:Class`` (read once a process)."""
    return installed_env_plugins()


def known_envs() -> dict[str, str]:
    """Every name that resolves now, with where it comes from (first source wins, as in ``env_class``)."""
    out = {name: "built-in" for name in BUILTIN_ENVS}
    for name, spec in _plugins.items():
        out.setdefault(name, f"envs.plugins: {spec}")
    for name, spec in installed().items():
        out.setdefault(name, f"entry point {ENV_ENTRY_POINT_GROUP}: {spec}")
    return out


def _import(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"plugin {spec!r} is not of the form module:Class")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):  # a path from configuration or package metadata, never from the model
        obj = getattr(obj, part)
    return obj


@lru_cache(maxsize=64)
def _load(name: str, spec: str) -> type:
    cls = _import(spec)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise TypeError(f"env {name!r} ({spec}) is not an environment class: it lacks {', '.join(missing) or 'a class'}")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"env {name!r} ({spec}): the class's name is {getattr(cls, 'name', None)!r}; register it "
                         f"under that name or set its `name = {name!r}` (tasks carry the name the engine resolves)")
    return cls


def env_class(name: str) -> type:
    """The environment class registered under ``name`` (module docstring for the order)."""
    if name == "toolworld":
        from .toolworld import ToolWorldEnv

        return ToolWorldEnv
    if name == "codegen":
        from .codegen import CodegenEnv

        return CodegenEnv
    spec = _plugins.get(name) or installed().get(name)
    if spec is None:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(known_envs())} (register one with envs.plugins "
                         f"or an entry point of group {ENV_ENTRY_POINT_GROUP!r})")
    return _load(name, spec)


def has_pretraining(name: str) -> bool:
    """Whether the env has pretraining worlds and an oracle (warm start, cold start, experience in context)."""
    return name in BUILTIN_ENVS


def _file_kwargs(cls) -> dict:
    return {"max_turns": getattr(cls, "max_turns", 8), "validate_spec": getattr(cls, "validate_spec", None)}


def env_splits(name: str) -> tuple[str, ...]:
    """The splits ``name`` has tasks for."""
    if name in BUILTIN_ENVS:
        return SPLITS
    cls = env_class(name)
    if name in _task_files:
        return file_splits(_task_files[name], name, **_file_kwargs(cls))
    return tuple(getattr(cls, "splits", PLUGIN_SPLITS))


def plugin_tasks(name: str, split: str, n: int, seed: int) -> list[Task]:
    """``n`` tasks of ``split`` for a plugin env, from its task file or its own ``make_tasks``."""
    cls = env_class(name)
    splits = env_splits(name)
    if split not in splits:
        raise ValueError(f"env {name!r} has no {split!r} tasks; its splits: {', '.join(splits)}")
    if name in _task_files:
        return tasks_from_file(_task_files[name], name, split, n, seed, **_file_kwargs(cls))
    make = getattr(cls, "make_tasks", None)
    if make is None:
        raise ValueError(f"env {name!r} has no tasks: give its class a make_tasks(split, n, seed) or set "
                         f"envs.task_files.{name} to a JSON Lines file")
    tasks = list(make(split, n, seed))
    wrong = [t for t in tasks if not isinstance(t, Task) or t.env != name or t.split != split]
    if wrong:
        raise ValueError(f"env {name!r}: make_tasks({split!r}, ...) returned {wrong[0]!r}, expected Tasks with "
                         f"env={name!r} and split={split!r}")
    return tasks

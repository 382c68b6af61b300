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
package metadata, never from model output. ``new_env`` builds the instances a run plays: a plugin behind the
per-step timeout, isolated in a sandboxed child with ``envs.isolate_tools`` (guarded.py). ``plugin_files`` names
the files a plugin brings (task file, package source), which the stages that play it key on.
"""

from __future__ import annotations

import importlib
import sys
from functools import lru_cache

from lopd_core.config import env_conflict_message, installed_env_conflicts, installed_env_plugins
from lopd_core.names import BUILTIN_ENVS, ENV_ENTRY_POINT_GROUP

from .base import SPLITS, Task
from .task_files import file_splits, tasks_from_file

PLUGIN_SPLITS = ("train", "test_id", "test_ood")

_plugins: dict[str, str] = {}  # envs.plugins of the run this process serves
_task_files: dict[str, str] = {}  # envs.task_files of that run
_isolate_tools = False  # envs.isolate_tools: plugin envs' reset/step in a sandboxed child (guarded.py)
_step_timeout_s = 30.0  # envs.step_timeout_s: the longest one reset or step of a plugin env may take


def use_config(envs) -> None:
    """Make an ``envs:`` config section's plugins, task files and plugin guard (isolation, step timeout) this
    process's (replacing earlier ones)."""
    global _plugins, _task_files, _isolate_tools, _step_timeout_s
    _plugins = dict(getattr(envs, "plugins", {}) or {})
    _task_files = dict(getattr(envs, "task_files", {}) or {})
    _isolate_tools = bool(getattr(envs, "isolate_tools", False))
    _step_timeout_s = float(getattr(envs, "step_timeout_s", 30.0))


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
    try:
        obj = importlib.import_module(module_name)
    except SystemExit as exc:  # a plugin that exits while imported would end the whole command without a word
        raise ImportError(f"plugin module {module_name!r} called sys.exit({exc.code!r}) while being imported") from None
    for part in attr.split("."):  # a path from configuration or package metadata, never from the model
        obj = getattr(obj, part)
    return obj


@lru_cache(maxsize=64)
def _load(name: str, spec: str) -> type:
    cls = _import(spec)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        lacks = ", ".join(missing) or "a class"
        raise TypeError(f"env {name!r} ({spec}) is not an environment class: it lacks {lacks}")
    if getattr(cls, "name", None) != name:
        raise ValueError(
            f"env {name!r} ({spec}): the class's name is {getattr(cls, 'name', None)!r}; register it "
            f"under that name or set its `name = {name!r}` (tasks carry the name the engine resolves)"
        )
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
        raise ValueError(
            f"unknown env {name!r}; known: {', '.join(known_envs())} (register one with envs.plugins "
            f"or an entry point of group {ENV_ENTRY_POINT_GROUP!r})"
        )
    if name not in _plugins and name in installed_env_conflicts():  # two packages claim it: neither wins silently
        raise ValueError(env_conflict_message(name, f"env {name!r}"))
    return _load(name, spec)


def _spec(name: str, plugins: dict[str, str]) -> str | None:
    return plugins.get(name) or installed().get(name)


def new_env(name: str):
    """A fresh, single-use instance of env ``name``: a built-in as it is; a plugin behind the step timeout, in a
    sandboxed child when ``envs.isolate_tools`` is on (guarded.py: the trust boundary)."""
    cls = env_class(name)
    if name in BUILTIN_ENVS:
        return cls()
    if _isolate_tools:
        from .isolated import IsolatedEnv

        return IsolatedEnv(name, _spec(name, _plugins), cls, _step_timeout_s)
    from .guarded import TimedEnv

    return TimedEnv(cls(), name, _step_timeout_s)


def isolation_note(name: str) -> str:
    """One line on where env ``name``'s tools run: the trust boundary, said where a user checks a plugin."""
    if name in BUILTIN_ENVS:
        return f"{name} is built in (model-written code runs only in the sandbox)"
    if _isolate_tools:
        return (
            f"{name}'s reset and step run isolated (envs.isolate_tools: a child process per episode with no "
            f"network, a scrubbed environment and only a private folder; {_step_timeout_s:g} s a step)"
        )
    return (
        f"{name}'s tools are trusted code: they run inside the trainer's process with the arguments the model "
        f"chose, and may read your files, environment variables and network; set envs.isolate_tools: true to "
        f"run them in the sandbox"
    )


def plugin_files(envs) -> dict[str, dict[str, list[str]]]:
    """The files each plugin env of ``envs.mix`` reads beyond lopd_core: its task file (``envs.task_files``, else
    the class's ``task_file``) and its package's source (the folder of the class's top-level package, or the
    module file of a top-level module). A stage that plays the env reads them, so they belong in its cache key.
    Resolves from ``envs`` itself, without changing this process's configuration."""
    plugins = dict(getattr(envs, "plugins", {}) or {})
    task_files = dict(getattr(envs, "task_files", {}) or {})
    out: dict[str, dict[str, list[str]]] = {}
    for name in sorted(envs.mix):
        if name in BUILTIN_ENVS:
            continue
        spec = _spec(name, plugins)
        if spec is None:  # refused at config load (EnvsConfig.check); a stage that plays it fails, naming it
            continue
        cls = _load(name, spec)
        task_file = task_files.get(name) or getattr(cls, "task_file", None)
        source: list[str] = []
        for module in {cls.__module__, spec.partition(":")[0]}:  # where the class is defined, where it is named
            top = sys.modules[module.split(".")[0]]
            source += list(getattr(top, "__path__", None) or [getattr(top, "__file__", None)])
        out[name] = {
            "task_file": [str(task_file)] if task_file else [],
            "source": sorted({str(s) for s in source if s}),
        }
    return out


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
        raise ValueError(
            f"env {name!r} has no tasks: give its class a make_tasks(split, n, seed) or set "
            f"envs.task_files.{name} to a JSON Lines file"
        )
    tasks = list(make(split, n, seed))
    wrong = [t for t in tasks if not isinstance(t, Task) or t.env != name or t.split != split]
    if wrong:
        raise ValueError(
            f"env {name!r}: make_tasks({split!r}, ...) returned {wrong[0]!r}, expected Tasks with "
            f"env={name!r} and split={split!r}"
        )
    return tasks

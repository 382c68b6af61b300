"""LOPD environments: the shared contract, the built-in ``toolworld`` environment and ``codegen``, and plugins.

base.py is the contract every environment implements and contract.py the checker that enforces it;
registry.py resolves an environment by name (built-ins, then ``envs.plugins``, then entry points of group
``lopd.envs``); tasks.py draws any environment's task sets (task_files.py: tasks as JSON Lines); mix.py spreads
a run's tasks over the environment mix; guarded.py is the plugin trust boundary (a per-step timeout, and with
``envs.isolate_tools`` each episode in a sandboxed child: isolated.py). The environments live in their own
packages: toolworld/ (stateful tool domains under worlds with different conventions), codegen/ (function-writing
tasks graded in sandbox/, the only place model code runs; isolated plugins borrow its layers), declarative/ (a
tool environment built from plain functions and task files, for plugins).
"""

from __future__ import annotations

from . import registry
from .base import SPLITS, Environment, FirstObservation, StepResult, Task
from .codegen import CodegenEnv
from .contract import check_env_contract
from .registry import env_class
from .tasks import make_tasks
from .toolworld import (
    DOMAINS,
    KNOBS,
    TEMPLATES,
    WORLDS,
    OraclePolicy,
    ToolWorldEnv,
    format_call,
    oracle_actions,
    parse_action,
    run_oracle,
    tool_schemas,
)

ENVS = {"toolworld": ToolWorldEnv, "codegen": CodegenEnv}  # the built-ins; plugins resolve in registry.py


def make_env(task_or_env_name: Task | str) -> Environment:
    """A fresh, single-use environment instance for a task (or an env name): a built-in, or a plugin behind the
    per-step timeout and, with ``envs.isolate_tools``, in a sandboxed child (guarded.py)."""
    name = task_or_env_name.env if isinstance(task_or_env_name, Task) else task_or_env_name
    return registry.new_env(name)


__all__ = [
    "DOMAINS",
    "ENVS",
    "KNOBS",
    "SPLITS",
    "TEMPLATES",
    "WORLDS",
    "CodegenEnv",
    "Environment",
    "FirstObservation",
    "OraclePolicy",
    "StepResult",
    "Task",
    "ToolWorldEnv",
    "check_env_contract",
    "env_class",
    "format_call",
    "make_env",
    "make_tasks",
    "oracle_actions",
    "parse_action",
    "run_oracle",
    "tool_schemas",
]

"""A tool environment declared as plain functions (or JSON-schema specs) and tasks in JSON Lines: env.py.

The common case of a plugin environment (registry.py): subclass ``DeclarativeToolEnv`` with a name, tools and a
task file, register the class (entry point group ``lopd.envs`` or ``envs.plugins``), and it is in the mix.
"""

from ..toolworld.tools import ToolError
from .env import DeclarativeToolEnv
from .tools import Tool, ToolSpec, schema_error, tool_table

__all__ = ["DeclarativeToolEnv", "Tool", "ToolError", "ToolSpec", "schema_error", "tool_table"]

"""Stateful tool domains of toolworld and their registry.

A domain owns one JSON-serialisable ``state`` dict and the world's ``conv`` for that domain.
Its tools are the methods marked ``@tool``; they are collected per class when the class is
defined, and an instance hands out an explicit ``name -> bound method`` table. Nothing is
ever looked up by a name that came from the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import ClassVar

from ..tools import ALL_SCHEMAS, TOOL_SPEC_ATTR, ToolError

DOMAINS: dict[str, type[Domain]] = {}


class Domain:
    name: ClassVar[str] = ""
    _tool_functions: ClassVar[dict[str, Callable]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        found: dict[str, Callable] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                if callable(value) and hasattr(value, TOOL_SPEC_ATTR):
                    found[attr] = value
        for tool_name in found:
            if not tool_name.startswith(cls.name + "_"):
                raise TypeError(f"tool {tool_name} must be named {cls.name}_<verb>")
        cls._tool_functions = found
        for tool_name, fn in found.items():
            ALL_SCHEMAS[tool_name] = getattr(fn, TOOL_SPEC_ATTR)
        DOMAINS[cls.name] = cls

    def __init__(self, state: dict, conv: dict):
        self.state = copy.deepcopy(state)
        self.conv = dict(conv)

    @classmethod
    def schemas(cls) -> list[dict]:
        return [getattr(fn, TOOL_SPEC_ATTR) for fn in cls._tool_functions.values()]

    def tool_table(self) -> dict[str, Callable]:
        """Declared tools bound to this instance; the only dispatch path."""
        return {name: fn.__get__(self, type(self)) for name, fn in self._tool_functions.items()}

    # helpers shared by domains -------------------------------------------------------
    @staticmethod
    def lookup(table: dict, key: str) -> dict:
        if key not in table:
            raise ToolError("not found")
        return table[key]

    @staticmethod
    def new_id(prefix: str, existing) -> str:
        n = 1
        while f"{prefix}{n}" in existing:
            n += 1
        return f"{prefix}{n}"


def tool_schemas(domain: str) -> list[dict]:
    """JSON schemas of a domain's tools, in declaration order."""
    return DOMAINS[domain].schemas()


def _load() -> None:
    import importlib

    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")  # registers the domain class


_MODULES = ("banking", "calendar", "shop", "files", "msg", "travel")


_load()

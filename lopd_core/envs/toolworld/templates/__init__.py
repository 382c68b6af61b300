"""Task templates: a registry of (generator, oracle) pairs.

A template's generator draws one instance for a world: the instruction (without the world
tag), the initial state of each domain, the data checks, the expected answer, and ``params``
— the values the instruction states, which are all the oracle may know up front. The oracle
is a Python generator that yields tool calls ``(name, arguments)``, receives each parsed
observation, reads ids/balances/slots from them, and returns the final answer text.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from ..worlds import WORLDS


@dataclass(frozen=True)
class Draft:
    instruction: str
    state: dict  # domain -> initial state
    checks: list
    params: dict = field(default_factory=dict)
    answer: str | None = None  # expected answer (None: any final message, oracle says "done")


OracleFn = Callable[[dict, dict], Generator]


@dataclass(frozen=True)
class Template:
    name: str
    domains: tuple[str, ...]
    split_group: str  # "train" | "ood"
    draw: Callable[[random.Random, dict], Draft]
    oracle: OracleFn

    def generate(self, rng: random.Random, world: str, worlds: dict | None = None) -> Draft:
        """One instance for ``world``, its conventions looked up in ``worlds`` (default: the named worlds)."""
        return self.draw(rng, (WORLDS if worlds is None else worlds)[world])


TEMPLATES: dict[str, Template] = {}


def template(name: str, domains: tuple[str, ...], oracle: OracleFn, split_group: str = "train"):
    """Register ``draw(rng, conventions) -> Draft`` as a template."""
    if split_group not in ("train", "ood"):
        raise ValueError(split_group)

    def deco(draw):
        if name in TEMPLATES:
            raise ValueError(f"duplicate template {name}")
        TEMPLATES[name] = Template(name, tuple(domains), split_group, draw, oracle)
        return draw

    return deco


_MODULES = ("t_bank", "t_calendar", "t_shop", "t_files", "t_msg", "t_travel", "t_cross", "t_ood")
for _m in _MODULES:
    importlib.import_module(f"{__name__}.{_m}")

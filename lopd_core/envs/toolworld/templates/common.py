"""Shared pieces for templates: name pools, id and date helpers, oracle call helpers."""

from __future__ import annotations

import datetime as _dt
import random

from ..formats import fmt_date, parse_date  # noqa: F401  (re-exported for templates)

PEOPLE = (
    "Mia",
    "Leo",
    "Ava",
    "Noah",
    "Ivy",
    "Omar",
    "Zoe",
    "Eli",
    "Nina",
    "Sam",
    "Ruth",
    "Theo",
    "Lena",
    "Hugo",
    "Ida",
    "Finn",
    "Maya",
    "Owen",
    "Cleo",
    "Jude",
    "Tara",
    "Axel",
    "Rosa",
    "Ben",
)
YEAR = 2026
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)


class Stuck(Exception):
    """The oracle cannot continue (an observation it needed was an error)."""


def call(tool_name: str, /, **arguments) -> tuple[str, dict]:
    return (tool_name, arguments)


def res(obs: dict):
    """The result of an observation, or Stuck if it was an error."""
    if not isinstance(obs, dict) or "result" not in obs:
        raise Stuck(str(obs))
    return obs["result"]


def ids(rng: random.Random, prefix: str, k: int, taken=()) -> list[str]:
    pool = [n for n in range(1, 100) if f"{prefix}{n}" not in taken]
    return [f"{prefix}{n}" for n in rng.sample(pool, k)]


def people(rng: random.Random, k: int) -> list[str]:
    return rng.sample(PEOPLE, k)


def rand_date(rng: random.Random, month: int | None = None) -> str:
    """ISO date in YEAR (days 1..28 so every month works)."""
    m = month or rng.randint(1, 12)
    return f"{YEAR}-{m:02d}-{rng.randint(1, 28):02d}"


def say_date(iso: str) -> str:
    """Natural form used in instructions: 'March 5'."""
    d = _dt.date.fromisoformat(iso)
    return f"{MONTHS[d.month - 1]} {d.day}"


def shift_date(iso: str, days: int) -> str:
    return (_dt.date.fromisoformat(iso) + _dt.timedelta(days=days)).isoformat()

"""The checks a setting can carry, and the one error every bad setting raises.

A check is a predicate plus the words of what it expects, so that a refusal reads the same wherever the value came
from (params.yaml, `--set`, or a section built in Python): `lopd.steps: got -1, expected a number > 0`.

Imports nothing of the library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class ConfigError(ValueError):
    """A key or value of params.yaml (or of a --set override, or of a section built in code) is not what the
    pipeline expects."""


class Check(NamedTuple):
    accepts: Callable[[Any], bool]
    expected: str  # completes "got V, expected ..."


REPLAY_AUTO = "auto"  # lopd.replay_share chosen by the run: `lopd cycle` replays, a single run does not
CYCLE_REPLAY_SHARE = 0.5  # what `auto` means in `lopd cycle` (measured against 0 and 0.25: docs/results.md)
MARGIN_AUTO = "auto"  # lopd.margin priced at the start of distillation (lopd_core/distill/update/margin.py)


def positive() -> Check:
    return Check(lambda v: v > 0, "a number > 0")


def non_negative() -> Check:
    return Check(lambda v: v >= 0, "a number >= 0")


def at_least(low: int) -> Check:
    return Check(lambda v: v >= low, f"an integer >= {low}")


def fraction() -> Check:
    return Check(lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def in_range(low: float, high: float, *, open_low: bool = False) -> Check:
    """low <= v <= high (low < v with open_low): for values where a huge one is a typo, not a choice."""
    return Check(
        lambda v: (low < v if open_low else low <= v) and v <= high,
        f"a number in {'(' if open_low else '['}{low:g}, {high:g}]",
    )


def one_of(*choices) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(map(repr, choices)))


def subset_of(*choices) -> Check:
    return Check(lambda v: len(v) > 0 and set(v) <= set(choices), "a non-empty list of " + ", ".join(choices))


def any_of(*choices) -> Check:
    """A list (possibly empty) of some of `choices`."""
    return Check(lambda v: set(v) <= set(choices), "a list of: " + ", ".join(choices))


def device_name() -> Check:
    return Check(
        lambda v: v in ("auto", "cpu", "mps", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
        "auto, cpu, cuda, cuda:N or mps",
    )


def margin_value() -> Check:
    """`auto`, or a number in [0, 10] (nats per action token: a huge one is a typo, not a choice)."""
    return Check(
        lambda v: v == MARGIN_AUTO or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 10.0),
        f"{MARGIN_AUTO!r} or a number in [0, 10]",
    )


def replay_value() -> Check:
    """`auto`, or a share in [0, 1] (the rules across keys then ask for a replay task and a fresh task per step)."""
    return Check(
        lambda v: v == REPLAY_AUTO or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0),
        f"{REPLAY_AUTO!r} or a number in [0, 1]",
    )


def positive_weights() -> Check:
    return Check(
        lambda v: bool(v) and all(w > 0 for w in v.values()), "a non-empty mapping of environments to weights > 0"
    )

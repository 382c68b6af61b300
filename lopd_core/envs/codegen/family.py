"""A codegen problem family: statement, function, reference solution and an input generator per difficulty.

The reference solution is a real, standalone module-level function named like the function the task asks
for. Two uses: the parent calls it (trusted code of ours, never model output) to compute expected outputs,
and its source text is the oracle's action — the demonstration a warm start trains on. Difficulty `level`
(1..3) grows inputs and, from level 2, adds the family's edge cases (empty lists, negatives, ties, ...).
"""

from __future__ import annotations

import inspect
import random
import string
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

LEVELS = (1, 2, 3)


@dataclass(frozen=True)
class Family:
    name: str
    topic: str  # arithmetic | conditionals | loops | strings | dicts | lists | algorithms
    group: str  # "train" (train / test_id) or "ood" (held out: test_ood only)
    reference: Callable
    statement: str  # what the function returns, in one or two sentences
    gen_args: Callable[[random.Random, int], list]  # (rng, level) -> one argument list
    edge_cases: tuple = field(default=())  # argument lists added from level 2 on

    @property
    def function(self) -> str:
        return self.reference.__name__

    @property
    def source(self) -> str:
        return textwrap.dedent(inspect.getsource(self.reference)).strip() + "\n"

    @property
    def signature(self) -> str:
        return self.source.splitlines()[0].removesuffix(":")


# ----------------------------------------------------------------- input helpers shared by the families
def size(rng: random.Random, level: int) -> int:
    return rng.randint(2, 4) if level == 1 else rng.randint(3, 7) if level == 2 else rng.randint(6, 12)


def int_list(rng: random.Random, level: int, lo: int | None = None, hi: int = 20) -> list[int]:
    lo = (0 if level == 1 else -hi) if lo is None else lo
    return [rng.randint(lo, hi) for _ in range(size(rng, level))]


def word(rng: random.Random, level: int, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 3 + 2 * level)))


def words(rng: random.Random, level: int) -> list[str]:
    pool = [
        "apple",
        "bird",
        "cat",
        "dog",
        "echo",
        "fig",
        "gold",
        "hat",
        "ink",
        "jam",
        "kite",
        "lamp",
        "moon",
        "nest",
        "owl",
        "pear",
        "quiz",
        "rose",
        "sun",
        "tree",
    ]
    return [rng.choice(pool) if level < 3 else word(rng, level) for _ in range(size(rng, level))]


def sentence(rng: random.Random, level: int) -> str:
    ws = words(rng, level)
    if level >= 2 and rng.random() < 0.5:
        ws = [w.capitalize() if rng.random() < 0.5 else w for w in ws]
    return " ".join(ws)

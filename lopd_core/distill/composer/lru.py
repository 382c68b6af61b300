"""A bounded mapping that drops its least recently used entry when full: the one cache type of the composer's and
the teacher's paths (composer.py's encodings, inputs.py's φ0 latents, teacher_play.py's latents, baselines.py's
oracle texts).

Why bounded: those caches are keyed per (query, experience) or per text, and under a query-conditioned composer
every new task brings new keys, so a plain dict grows for as long as the run lasts. Why not `functools.lru_cache`:
it memoises one call at a time, and these caches are filled in batches (one forward of the base encodes every
text a step misses), so they need a mapping to look up, fill and clear (a teacher refresh drops the old base's
encodings). A lookup counts as a use; `in` does not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# 4096 entries: more than every (task, row) pair a distillation run at the default reads (lopd.steps 64 ×
# lopd.tasks_per_step 8 × bank.top_j 3 = 1,536) and than every row of the default bank (bank.seed_tasks 200 × 2
# samples, growing by refresh), so at the default nothing is read twice for want of room; a longer run or a cold
# start (coldstart.steps 300 × batch 16 × 3 pairs) re-reads its oldest pairs, no more. At the default's width (128)
# and composer.max_experience_tokens 256 an encoding is at most 128 KiB, so a full cache of encodings holds at most
# 512 MiB of CPU memory (of φ0's (K, D) latents: 64 MiB); at a 1024-wide base, 4 GiB: pass a smaller capacity.
DEFAULT_CAPACITY = 4096


class LRUCache(Generic[K, V]):
    """At most `capacity` entries; putting one more drops the least recently used (looked up or put)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"an LRU cache holds at least one entry: got capacity {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The entry of `key`, now the most recently used; None when there is none."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: K, value: V) -> None:
        """Keep `value` under `key` as the most recently used, dropping the least recently used past capacity."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def keys(self) -> list[K]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

"""The one bounded cache of the composer's and the teacher's paths (lopd_core/distill/composer/lru.py): at capacity
the least recently used entry goes, where a lookup counts as a use and `in` does not."""

import pytest

from lopd_core.distill.composer.lru import LRUCache


def test_a_cache_at_capacity_evicts_the_least_recently_used():
    cache: LRUCache[str, int] = LRUCache(capacity=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a used: b is now the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("b") is None
    assert cache.keys() == ["a", "c"] and len(cache) == 2
    assert "a" in cache  # `in` is no use: a stays the least recently used
    cache.put("d", 4)
    assert cache.keys() == ["c", "d"]
    cache.put("c", 30)  # putting again is a use and replaces the value
    cache.put("e", 5)
    assert cache.keys() == ["c", "e"] and cache.get("c") == 30
    cache.clear()
    assert len(cache) == 0


def test_a_cache_holds_at_least_one_entry():
    with pytest.raises(ValueError, match="at least one entry"):
        LRUCache(capacity=0)

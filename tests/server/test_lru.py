"""vaed.lru.LruCache: the one bounded cache type (CUDA graphs and signatures in vaed.graphs)."""

from __future__ import annotations

import pytest

from vaed.lru import LruCache


def test_keeps_the_latest_members() -> None:
    recent: LruCache[str, None] = LruCache(3)
    for item in "abcd":
        recent[item] = None
    assert len(recent) == 3 and "a" not in recent and all(i in recent for i in "bcd")
    recent["b"] = None  # re-storing makes it the newest
    recent["e"] = None
    assert "c" not in recent and all(i in recent for i in "bde")
    recent.pop("d")
    assert recent.pop("zz") is None  # absent: nothing happens
    assert len(recent) == 2
    assert list(recent) == ["b", "e"]  # oldest first


def test_get_counts_as_use_and_in_does_not() -> None:
    graphs: LruCache[str, int] = LruCache(2)
    graphs["a"], graphs["b"] = 1, 2
    assert graphs.get("a") == 1  # "a" is now the newest
    graphs["c"] = 3
    assert list(graphs) == ["a", "c"] and graphs.get("b") is None
    assert "a" in graphs  # membership does not reorder
    graphs["d"] = 4
    assert list(graphs) == ["c", "d"]
    graphs["c"] = 30  # replacing a value is a use
    graphs["e"] = 5
    assert list(graphs) == ["c", "e"] and graphs.get("c") == 30


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_must_hold_one_entry(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LruCache(limit)

"""BoundedLRU: the runtime's one count-bounded map (issue 42)."""

from __future__ import annotations

import pytest

from meshnet_runtime.bounded import BoundedLRU


def test_a_write_makes_its_key_newest_and_the_oldest_goes_past_maxsize() -> None:
    seen: BoundedLRU[str, int] = BoundedLRU(2)
    seen["a"], seen["b"] = 1, 2
    seen["a"] = 3  # written again: now the newest
    seen["c"] = 4
    assert list(seen.items()) == [("a", 3), ("c", 4)]


def test_a_read_keeps_the_order() -> None:
    seen: BoundedLRU[str, int] = BoundedLRU(2)
    seen["a"], seen["b"] = 1, 2
    assert seen.get("a") == 1 and seen["a"] == 1
    seen["c"] = 3
    assert list(seen) == ["b", "c"]


def test_update_goes_through_the_bound_too() -> None:
    seen: BoundedLRU[int, None] = BoundedLRU(3)
    seen.update(dict.fromkeys(range(10)))
    assert list(seen) == [7, 8, 9]


def test_maxsize_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        BoundedLRU(0)

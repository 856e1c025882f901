"""A map that keeps at most ``maxsize`` entries, the least recently written
dropped first: what the runtime remembers about peers it does not control
(block keys a replica filed, sessions whose history has a gap) grows with
their traffic, so each such memory is bounded by count."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["BoundedLRU"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(OrderedDict[K, V]):
    """An ``OrderedDict`` whose every write makes its key the newest and then
    drops the oldest entries past ``maxsize``. A read changes no order: a key
    stays as long as it keeps being written, not looked at."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)

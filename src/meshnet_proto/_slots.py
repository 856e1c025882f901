"""Building a frozen, slotted value from values already checked."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["slot_setters"]


def slot_setters(cls: type, names: Iterable[str]) -> tuple[Callable[[Any, Any], None], ...]:
    """The setter of each slot ``names`` of the slotted class ``cls``.

    A slot set through its setter skips a frozen dataclass's ``__setattr__``
    and the checks of its ``__init__``: only for values the builder has
    checked itself (a parsed head, a table's own ticket). It costs a third
    of ``object.__setattr__``, which matters on a decode step's path.
    """
    return tuple(cls.__dict__[name].__set__ for name in names)

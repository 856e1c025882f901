"""What both connection roles do alike with the h11 they wrap: feed it bytes
and pull its events until one means something to the role.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import h11

from ._events import NEED_DATA, NeedData
from ._limits import Limits

__all__ = ["H11Reader"]


_E = TypeVar("_E")


class H11Reader(Generic[_E]):
    """The reading half shared by `ServerConnection` and `ClientConnection`.

    A role implements ``_handle(event)``: None for an h11 event that only
    advanced its own bookkeeping (a body piece, a 100 Continue), else the
    role's event to return.
    """

    def __init__(self, role: type[h11.CLIENT] | type[h11.SERVER], limits: Limits) -> None:
        self._h11 = h11.Connection(role, max_incomplete_event_size=limits.max_header_bytes)
        # True from h11's NEED_DATA until bytes are fed to it: it holds none,
        # so the next bytes of a Content-Length body may skip it (`_body_bypass`).
        self._h11_drained = False

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        self._h11_drained = False
        self._h11.receive_data(data)  # type: ignore[arg-type]  # any bytes-like

    def _pump(self) -> _E | NeedData:
        """h11's events through ``_handle`` until one yields a result, or
        `NEED_DATA`; h11's and the role's errors propagate."""
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                self._h11_drained = True  # h11 holds no unread byte now
                return NEED_DATA
            result = self._handle(event)
            if result is not None:
                return result

    def _handle(self, event: object) -> _E | None:  # pragma: no cover - each role has one
        raise NotImplementedError

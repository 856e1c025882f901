"""Stop sequences: generated text cut at the first one, never shown in part."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopFilter"]


class StopFilter:
    """Cuts generated text at the first stop sequence.

    Text that might be the start of a stop sequence is held back until the
    next piece shows whether it is one, so a stop sequence split across
    tokens never reaches the client.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop sequence was reached)."""
        text = self._pending + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self._pending = ""
            return text[: min(found)], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest

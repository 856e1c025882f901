"""A session's line on the nodes, as the gateway sends it (wire-2 §3.16).

With verify windows in flight the nodes hold more than the session has
accepted: every window sent ran (or will run) at every stage, accepted or
not. ``Lines`` keeps how far ahead of the accepted position the nodes will
be once every chunk sent has run, and the session's epoch (the rewinds it
was sent), so that each chunk carries the right ``X-Meshnet-After``: a
successor names the position the chunks before it leave, a rewind the same
position and the next epoch. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnet_proto.lowlevel import AfterSpec

__all__ = ["Lines"]


class Lines:
    """A session's line on the nodes (wire-2 §3.16): how many tokens the
    nodes will hold past the accepted position once every chunk sent has run
    (``ahead``; held = accepted + ahead), and the epoch (rewinds sent)."""

    def __init__(self) -> None:
        self.ahead = 0
        self.epoch = 0
        # Block keys of accepted tokens that came in windows: no node filed them.
        self.unfiled: set[str] = set()

    def held(self, position: int) -> int:
        return position + self.ahead

    def window(self, position: int, start: int, tokens: int) -> AfterSpec:
        """``After`` for a window of ``tokens`` at ``start`` when ``position``
        is accepted: a rewind (the next epoch) when ``start`` is before the
        position held, else the successor of every chunk sent."""
        held = position + self.ahead
        if start < held:
            self.epoch += 1
        self.ahead = start + tokens - position
        return AfterSpec(position=held, epoch=self.epoch)

    def plain(self, position: int) -> AfterSpec | None:
        """``After`` for a plain step at the accepted ``position``: a rewind
        while the nodes hold more, else none (routed as wire-2 §3.2 says)."""
        if self.ahead == 0:
            return None
        held, self.ahead = position + self.ahead, 0
        self.epoch += 1
        return AfterSpec(position=held, epoch=self.epoch)

    def filed(self, keys: Sequence[str]) -> Sequence[str]:
        """``keys`` less those no node filed: what the prefix index may believe."""
        if not self.unfiled:
            return keys
        return [key for key in keys if key not in self.unfiled]

"""When a connection's current phase ends it: one cancel scope per connection.

A connection is timed phase by phase: the head's timeout (then an
endpoint's body timeout), none while the application works (it keeps its own
deadlines), the write's timeout while an answer goes out. One cancel scope
serves the connection's whole life instead of a new one per head and per
answer: a trio scope costs ~10 us, and the two were ~8 % of the node's CPU
per decode step (section decode). A deadline that passes ends the
connection, so the scope never needs to outlive one.

Moving that scope's deadline three times a request was another ~5 %, so a
server that listens keeps the deadlines itself: each phase only writes down
when it ends (``expires``) and the server's watchdog
(``HttpServer.watch_deadlines``) cancels the scope once that is past, at
most one ``ServerSettings.watch_interval`` late. A connection served without
the watchdog (``serve_stream`` on its own) moves its scope's deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import anyio

__all__ = ["PhaseDeadline"]


@dataclass(eq=False, slots=True)
class PhaseDeadline:
    """The deadline of a connection's current phase, on the loop's clock."""

    now: Callable[[], float]
    watched: bool  # kept by the server's watchdog for the connection's life
    scope: anyio.CancelScope | None = None  # the connection's, while it runs
    expires: float = math.inf  # when the current phase ends it; inf: never

    def expire_in(self, seconds: float) -> None:
        """The current phase ends the connection ``seconds`` from now."""
        self.expires = self.now() + seconds
        if not self.watched:
            assert self.scope is not None  # set while the connection runs
            self.scope.deadline = self.expires

    def clear(self) -> None:
        """The current phase has no deadline (the application's): no clock read."""
        self.expires = math.inf
        if not self.watched:
            assert self.scope is not None  # set while the connection runs
            self.scope.deadline = math.inf

    def expire_if_due(self, now: float) -> None:
        """The watchdog's look: end the connection past its phase's deadline."""
        if now >= self.expires and self.scope is not None:
            self.scope.cancel()

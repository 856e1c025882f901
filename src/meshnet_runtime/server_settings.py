"""The serving loop's settings: its timeouts, its connection cap, and the
back-off it asks of a client it turns away."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    head_timeout: float = 10.0  # wire-2 §4: 408 when the head is slower
    body_timeout: float = 60.0  # the whole body; the server's --timeout
    write_timeout: float = 60.0  # one answer to a peer that stopped reading
    max_connections: int = 256
    # In-flight requests get this long after SIGINT/SIGTERM: long enough for a
    # request under way, short enough that Ctrl-C feels like it (uvicorn-like;
    # a stream still open then is ended with a final event, not cut).
    shutdown_timeout: float = 5.0
    retry_after: int = 1  # seconds, on 503 too_many_connections / shutting_down

    @property
    def watch_interval(self) -> float:
        """How often the deadline watchdog looks (``HttpServer.watch_deadlines``):
        a tenth of the shortest connection timeout, within 10 ms and 1 s, so a
        timeout ends its connection at most that much late."""
        shortest = min(self.head_timeout, self.body_timeout, self.write_timeout)
        return min(max(shortest / 10, 0.01), 1.0)

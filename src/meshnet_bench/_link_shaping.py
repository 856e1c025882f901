"""How an emulated link moves one direction's bytes: the time model, then the
tasks that carry one connection's pieces through it.

`LinkSchedule` is the model, apart from I/O: every time is an argument, so it
is tested with made-up times. `Bottleneck` serves it in real time for all the
link's connections, and `pump` reads, queues, sleeps and writes one direction
of one connection.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import anyio
from anyio.abc import ByteStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["PROFILES", "Bottleneck", "LinkProfile", "LinkSchedule", "QueuedBytes", "pump"]

PIECE_BYTES: Final = 64 * 1024  # one receive, as the project's HTTP drivers read

# The event loops wait on epoll, whose timeout is whole milliseconds rounded
# up: on their own, a lan profile's 0.25 ms would take over 1 ms. So a writer
# sleeps on the loop until this long before a release time, and in a worker
# thread (time.sleep, good to tens of microseconds) for the rest.
LOOP_TIMER_SLACK_S: Final = 0.0015

# A piece on its way to the far end: when to hand it over, and its bytes
# (empty: the end of the stream, which travels like any byte).
_Piece = tuple[float, bytes]


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """One direction of a link.

    ``delay_s``: one-way propagation delay, added after serialization.
    ``rate_bps``: the bottleneck's rate in bits per second; None for no limit.
    ``jitter_s``: extra delay drawn uniformly from [0, jitter_s] per piece;
    it never reorders bytes (see `LinkSchedule`).
    """

    delay_s: float
    rate_bps: float | None
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        rate = self.rate_bps
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate_bps must be a finite number > 0 or None, got {rate!r}")

    def describe(self) -> str:
        """``5 ms, 100 Mbit/s`` — the profile as a person reads it."""
        parts = [f"{self.delay_s * 1e3:g} ms"]
        if self.jitter_s:
            parts.append(f"jitter {self.jitter_s * 1e3:g} ms")
        parts.append(
            "no rate limit" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        )
        return ", ".join(parts)


# Typical one-way figures for the links a pipeline's hops cross; read-only so
# that one bench cannot change what the next one measures.
PROFILES: Final = MappingProxyType(
    {
        "loopback": LinkProfile(delay_s=0.0, rate_bps=None),
        "lan": LinkProfile(delay_s=0.25e-3, rate_bps=1e9),
        "wifi": LinkProfile(delay_s=5e-3, rate_bps=100e6),
        "wan": LinkProfile(delay_s=20e-3, rate_bps=50e6),
    }
)


class LinkSchedule:
    """When each piece carried in one direction is done on the link, and when it
    reaches the far end.

    The link is a FIFO bottleneck: a piece of n bytes occupies it for
    n * 8 / rate seconds (`serialize`), starting when it arrives or when the
    piece before it is done, whichever is later; then it propagates for the
    delay plus jitter (`propagate`). A piece is released whole at the end of
    its serialization — a packet-level model would release its first bytes
    sooner, but pieces are at most 64 KiB (about 0.5 ms at 1 Gbit/s), and whole
    pieces keep the rate exact.

    Release times never decrease: a jittered piece holds back the ones after
    it, as a stream's bytes cannot overtake each other.
    """

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.profile = profile
        self._rng = rng
        self._link_free_at = -math.inf
        self._last_release = -math.inf

    def serialize(self, arrival: float, size: int) -> float:
        """When a piece of ``size`` bytes that reached the link at ``arrival`` is
        all on the wire (size 0: an end of stream, which takes no time)."""
        done = max(arrival, self._link_free_at)
        if self.profile.rate_bps is not None:
            done += size * 8 / self.profile.rate_bps
        self._link_free_at = done
        return done

    def propagate(self, serialized: float) -> float:
        """When a piece serialized at ``serialized`` is handed to the far end."""
        profile = self.profile
        jitter = self._rng.uniform(0.0, profile.jitter_s) if profile.jitter_s else 0.0
        self._last_release = max(self._last_release, serialized + profile.delay_s + jitter)
        return self._last_release


class QueuedBytes:
    """Back-pressure by bytes: `take` waits while the queue holds ``limit`` bytes.

    A queue bounded by its count of pieces would bound memory only for large
    pieces and would throttle a stream of small writes; this bounds the bytes.
    A piece larger than the limit still passes when the queue is empty, so
    nothing waits forever. One taker at a time: the direction's reader.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = anyio.Event()

    async def take(self, size: int) -> None:
        while self.held and self.held + size > self.limit:
            await self._freed.wait()
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size
        self._freed.set()
        self._freed = anyio.Event()


class Bottleneck:
    """One direction of the link, shared by all its connections: a FIFO queue
    that one task serves at the rate, handing each piece on to its connection.

    Serializing in real time, rather than stamping each piece when it is read,
    is what lets a connection that closes take its queued bytes with it: they
    never reach the link, so they delay no other connection's bytes.
    """

    def __init__(self, schedule: LinkSchedule, sleepers: anyio.CapacityLimiter) -> None:
        self.schedule = schedule
        self.sleepers = sleepers
        self.carried = 0  # bytes handed to the far end, over all connections
        self._waiting, self._served = anyio.create_memory_object_stream[
            tuple[float, bytes, MemoryObjectSendStream[_Piece]]
        ](math.inf)

    def enter(self, piece: bytes, onward: MemoryObjectSendStream[_Piece]) -> None:
        self._waiting.send_nowait((anyio.current_time(), piece, onward))

    async def serve(self) -> None:
        with self._waiting, self._served:
            async for arrival, piece, onward in self._served:
                if onward.statistics().open_receive_streams == 0:
                    continue  # its connection is gone
                serialized = self.schedule.serialize(arrival, len(piece))
                # The link is busy until then; waking a little early is fine,
                # as the writer waits precisely for the release time.
                await anyio.sleep_until(serialized - LOOP_TIMER_SLACK_S)
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    onward.send_nowait((self.schedule.propagate(serialized), piece))


async def pump(source: ByteStream, sink: ByteStream, link: Bottleneck, queued: QueuedBytes) -> None:
    """Carry one direction of one connection until its end of stream is delivered."""
    onward, arriving = anyio.create_memory_object_stream[_Piece](math.inf)
    # Closed on the way out, however it ends: the link then drops what it
    # still holds of this connection.
    with onward, arriving:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_deliver, arriving, sink, link, queued)
            await _take_in(source, link, onward, queued)


async def _take_in(
    source: ByteStream,
    link: Bottleneck,
    onward: MemoryObjectSendStream[_Piece],
    queued: QueuedBytes,
) -> None:
    """Read pieces as they come and queue them on the link, the end of stream last."""
    while True:
        try:
            piece = await source.receive(PIECE_BYTES)
        except anyio.EndOfStream:
            piece = b""
        # A piece reaches the link once the queue has room: until then the
        # sender is held, as a full bottleneck queue holds a real one.
        await queued.take(len(piece))
        link.enter(piece, onward)
        if not piece:
            return


async def _deliver(
    arriving: MemoryObjectReceiveStream[_Piece],
    sink: ByteStream,
    link: Bottleneck,
    queued: QueuedBytes,
) -> None:
    """Hand each piece to the far end at its release time; then its end of stream."""
    async for release_at, piece in arriving:
        if arriving.statistics().current_buffer_used:
            # Inside a burst: the schedule keeps its pace exact however late
            # each wake-up is, so the thread hop a precise wait costs is saved.
            await anyio.sleep_until(release_at)
        else:  # the last piece waiting (a request, a token): its time is what counts
            await _sleep_precisely_until(release_at, link.sleepers)
        if not piece:
            await _send_eof(sink)
            return
        await sink.send(piece)
        link.carried += len(piece)
        queued.give_back(len(piece))


async def _sleep_precisely_until(deadline: float, sleepers: anyio.CapacityLimiter) -> None:
    """Return at ``deadline`` (anyio's clock): measured 0.2 to 0.4 ms late on a 2-vCPU
    VM, where the loop's timer alone was 0.6 to 0.7 ms late (0.9 ms on a 0.25 ms wait)."""
    if anyio.current_time() < deadline - LOOP_TIMER_SLACK_S:
        await anyio.sleep_until(deadline - LOOP_TIMER_SLACK_S)
    if (remaining := deadline - anyio.current_time()) > 0:
        await anyio.to_thread.run_sync(
            time.sleep, remaining, abandon_on_cancel=True, limiter=sleepers
        )


async def _send_eof(sink: ByteStream) -> None:
    """Half-close where the stream can (TCP); close it where it cannot (TLS)."""
    try:
        await sink.send_eof()
    except NotImplementedError:
        await sink.aclose()

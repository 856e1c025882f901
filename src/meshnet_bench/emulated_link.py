"""A userspace link emulator: a TCP proxy that delays and rate-limits each direction.

The machines these benches run on have no netem, so a bench puts one of these
in front of each node of a chain (gateway → link → node 1, node 1 → link →
node 2, …) and reads how many bytes crossed each hop::

    async with EmulatedLink.serving("127.0.0.1", node_port, up=PROFILES["wifi"]) as link:
        ...  # send the hop to link.host_port instead of the node
        per_token = (link.bytes_up + link.bytes_down) / tokens

By hand: ``python -m meshnet_bench.emulated_link --target 127.0.0.1:8000 --profile wifi``.

Each direction (up: client → target, down: target → client) is one FIFO
bottleneck with a rate, then a propagation delay and optional jitter that
never reorders bytes (`LinkSchedule`). The bottleneck is shared by all the
link's connections, as on a real link: four pooled connections get the rate
once, not four times. What it does not model: loss, TCP's congestion window
(a fast sender fills the queue up to ``max_queued_bytes`` per direction per
connection) and connection setup (the client's connect completes at loopback
speed, since the proxy accepts before it dials the target — rare where the
hops keep their connections open). A piece reaches the far end a few tenths
of a millisecond after its release time (waking up takes that long; see
LOOP_TIMER_SLACK_S), so delays well under a millisecond come out long.

Only the standard library and anyio: it runs on trio and on asyncio and
imports nothing else of meshnet.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Final, NoReturn

import anyio
from anyio.abc import ByteStream, SocketAttribute, SocketStream

from meshnet_bench._link_shaping import (
    PROFILES,
    Bottleneck,
    LinkProfile,
    LinkSchedule,
    QueuedBytes,
    pump,
)

__all__ = [
    "MAX_QUEUED_BYTES",
    "PROFILES",
    "EmulatedLink",
    "LinkProfile",
    "LinkSchedule",
    "QueuedBytes",
    "main",
]

# Per direction per connection: over a second of a 100 Mbit/s link, so the
# queue never throttles a bench, while a sender faster than the link cannot
# make the proxy hold unbounded memory.
MAX_QUEUED_BYTES: Final = 16 * 1024 * 1024

# Worker threads a link may keep sleeping at once: two per connection (one per
# direction) for 32 connections; beyond that, releases run late, not wrong.
PRECISE_SLEEPERS: Final = 64

# A peer that resets, or a socket closed under a pump: the pair ends, the link serves on.
_CONNECTION_ERRORS: Final = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class EmulatedLink:
    """A running link (made by `serving`): where it listens, what it carried."""

    def __init__(
        self,
        address: tuple[str, int],
        target: tuple[str, int],
        up: LinkProfile,
        down: LinkProfile,
        *,
        seed: int = 0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        if max_queued_bytes < 1:
            raise ValueError(f"max_queued_bytes must be at least 1, got {max_queued_bytes}")
        self.host, self.port = address
        self.target = target
        self.max_queued_bytes = max_queued_bytes
        # Seeded per direction: the same run draws the same jitter.
        sleepers = anyio.CapacityLimiter(PRECISE_SLEEPERS)
        self._up = Bottleneck(LinkSchedule(up, random.Random(f"{seed}/up")), sleepers)
        self._down = Bottleneck(LinkSchedule(down, random.Random(f"{seed}/down")), sleepers)
        self._connections = 0

    @classmethod
    @asynccontextmanager
    async def serving(
        cls,
        target_host: str,
        target_port: int,
        *,
        up: LinkProfile = PROFILES["loopback"],
        down: LinkProfile | None = None,
        seed: int = 0,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> AsyncIterator[EmulatedLink]:
        """Listen (port 0: a free one) and carry connections to the target for
        the duration of the block. ``down`` defaults to the same profile as ``up``."""
        listener = await anyio.create_tcp_listener(local_host=listen_host, local_port=listen_port)
        address = (listen_host, listener.extra(SocketAttribute.local_port))
        down = up if down is None else down
        target = (target_host, target_port)
        link = cls(address, target, up, down, seed=seed, max_queued_bytes=max_queued_bytes)
        failure: Exception | None = None
        async with listener, anyio.create_task_group() as tasks:
            tasks.start_soon(link._up.serve)
            tasks.start_soon(link._down.serve)
            tasks.start_soon(listener.serve, link._carry_connection, tasks)
            try:
                yield link
            except Exception as exc:  # raised as itself below, not inside the task group's group
                failure = exc
            finally:
                tasks.cancel_scope.cancel()
        if failure is not None:
            raise failure

    @property
    def host_port(self) -> str:
        """``127.0.0.1:PORT``: what a hop dials instead of the target."""
        return f"{self.host}:{self.port}"

    def url_for(self, path: str = "", scheme: str = "http") -> str:
        """``http://127.0.0.1:PORT`` (a base URL, as ``--next`` takes), or with ``/path``."""
        base = f"{scheme}://{self.host_port}"
        return f"{base}/{path.lstrip('/')}" if path else base

    def retune(self, up: LinkProfile, down: LinkProfile | None = None) -> None:
        """Shape from now on by other profiles (``down``: the same as ``up``), so a
        bench runs one chain over several; pieces already on the link keep their times."""
        self._up.schedule.profile = up
        self._down.schedule.profile = up if down is None else down

    @property
    def bytes_up(self) -> int:
        """Bytes handed to the target so far, over all connections."""
        return self._up.carried

    @property
    def bytes_down(self) -> int:
        """Bytes handed back to clients so far, over all connections."""
        return self._down.carried

    @property
    def connections(self) -> int:
        """Connections accepted so far, the refused and the reset ones included."""
        return self._connections

    async def _carry_connection(self, client: SocketStream) -> None:
        self._connections += 1
        async with client:
            try:
                target = await anyio.connect_tcp(*self.target)
            except OSError:
                return  # refused or unreachable: the client sees its connection closed
            async with target, anyio.create_task_group() as pair:

                async def carry(source: ByteStream, sink: ByteStream, link: Bottleneck) -> None:
                    try:
                        await pump(source, sink, link, QueuedBytes(self.max_queued_bytes))
                    except* _CONNECTION_ERRORS:
                        pair.cancel_scope.cancel()  # one side failed: close both, like a reset

                pair.start_soon(carry, client, target, self._up)
                pair.start_soon(carry, target, client, self._down)


# -- the command line ----------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """A refusal is one line on stderr, exit 2 — not the usage block first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _at_least_zero(text: str) -> float:
    if (value := _finite(text)) < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _above_zero(text: str) -> float:
    if (value := _finite(text)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _parser() -> _OneLineParser:
    parser = _OneLineParser(
        prog="python -m meshnet_bench.emulated_link",
        description="A TCP proxy that delays and rate-limits both directions (no netem needed).",
    )
    add = parser.add_argument
    add("--listen", type=_address, default=("127.0.0.1", 0), help="HOST:PORT, port 0: a free one")
    add("--target", type=_address, required=True, help="HOST:PORT to forward to")
    add("--profile", choices=sorted(PROFILES), default="loopback", help="both directions")
    add("--delay-ms", type=_at_least_zero, help="one-way delay, instead of the profile's")
    add("--jitter-ms", type=_at_least_zero, help="jitter, instead of the profile's")
    add("--rate-mbit", type=_above_zero, help="rate in Mbit/s, instead of the profile's")
    add("--seed", type=int, default=0, help="seed of the jitter (default 0)")
    add("--async-backend", choices=("trio", "asyncio"), default="trio")
    return parser


def _profile(args: argparse.Namespace) -> LinkProfile:
    base = PROFILES[args.profile]
    return LinkProfile(
        delay_s=base.delay_s if args.delay_ms is None else args.delay_ms / 1e3,
        rate_bps=base.rate_bps if args.rate_mbit is None else args.rate_mbit * 1e6,
        jitter_s=base.jitter_s if args.jitter_ms is None else args.jitter_ms / 1e3,
    )


async def _serve_forever(args: argparse.Namespace, profile: LinkProfile) -> None:
    (listen_host, listen_port), (target_host, target_port) = args.listen, args.target
    serving = EmulatedLink.serving(
        target_host,
        target_port,
        up=profile,
        seed=args.seed,
        listen_host=listen_host,
        listen_port=listen_port,
    )
    async with serving as link:
        print(f"listening on {link.host_port}", flush=True)
        shaping = f"{target_host}:{target_port}, {profile.describe()} each way"
        print(f"forwarding to {shaping}", file=sys.stderr, flush=True)
        await anyio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        profile = _profile(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        anyio.run(_serve_forever, args, profile, backend=args.async_backend)
    except KeyboardInterrupt:
        pass  # interrupted is how it ends
    except OSError as exc:  # connections' errors end their pair: this one is the listener's
        host, port = args.listen
        print(f"{parser.prog}: error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

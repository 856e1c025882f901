"""Fault injection for the fault and load tests: a TCP proxy that loses messages.

``FaultProxy`` sits between a sender and a node on loopback and relays bytes
both ways. ``drop(request_head)`` decides, per request, whether to lose it:

* ``"response"`` — the request is forwarded whole and the node answers, but
  the proxy cuts both connections as the answer's first bytes arrive, so the
  node did the work and the sender never hears of it (a lost response);
* ``"request"`` — the connection is cut as the request head arrives, before
  any of it reaches the node;
* ``None`` — relayed untouched.

Requests and responses alternate on a connection (our clients never
pipeline), so "the next bytes from the node after request bytes" is the
start of that request's answer.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.abc

Drop = Literal["response", "request"] | None
_HEADER = re.compile(
    rb"(?im)^(x-meshnet-session|x-meshnet-chunk-index|x-meshnet-position):\s*(\S+)"
)


def chunk_of(head: bytes) -> tuple[str, int, int] | None:
    """(session, index, position) of a ``POST /forward`` head, else None."""
    if not head.startswith(b"POST /forward"):
        return None
    found = {name.lower(): value for name, value in _HEADER.findall(head)}
    try:
        return (
            found[b"x-meshnet-session"].decode(),
            int(found[b"x-meshnet-chunk-index"]),
            int(found[b"x-meshnet-position"]),
        )
    except KeyError:
        return None


def drop_first_attempts(times: int, mode: Drop = "response") -> Callable[[bytes], Drop]:
    """Lose the first ``times`` transmissions of every chunk (as ``mode``)."""
    seen: Counter[tuple[str, int, int]] = Counter()

    def decide(head: bytes) -> Drop:
        key = chunk_of(head)
        if key is None:
            return None
        seen[key] += 1
        return mode if seen[key] <= times else None

    return decide


@dataclass
class FaultProxy:
    target_host: str
    target_port: int
    drop: Callable[[bytes], Drop] = lambda head: None
    url: str = ""
    dropped: Counter[str] = field(default_factory=Counter)
    relayed: int = 0

    async def _pipe_up(
        self,
        client: anyio.abc.ByteStream,
        upstream: anyio.abc.ByteStream,
        state: dict[str, object],
        cut: anyio.CancelScope,
    ) -> None:
        async for data in client:
            if not state["in_request"]:
                # First bytes of a new request: its head (in full, for the
                # sizes our tests send, since heads are written in one send).
                state["in_request"] = True
                decision = self.drop(bytes(data[:8192]))
                state["decision"] = decision
                if decision == "request":
                    self.dropped["request"] += 1
                    cut.cancel()
                    return
            await upstream.send(data)
        await upstream.send_eof()

    async def _pipe_down(
        self,
        client: anyio.abc.ByteStream,
        upstream: anyio.abc.ByteStream,
        state: dict[str, object],
        cut: anyio.CancelScope,
    ) -> None:
        async for data in upstream:
            if state["in_request"]:
                state["in_request"] = False  # the node is answering it
                if state["decision"] == "response":
                    self.dropped["response"] += 1
                    cut.cancel()
                    return
                self.relayed += 1
            await client.send(data)
        await client.send_eof()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        try:
            upstream = await anyio.connect_tcp(self.target_host, self.target_port)
        except OSError:
            await client.aclose()
            return
        state: dict[str, object] = {"in_request": False, "decision": None}
        try:
            async with anyio.create_task_group() as tg:
                cut = tg.cancel_scope
                tg.start_soon(self._pipe_up, client, upstream, state, cut)
                tg.start_soon(self._pipe_down, client, upstream, state, cut)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                await client.aclose()


@asynccontextmanager
async def fault_proxy(
    target_url: str, drop: Callable[[bytes], Drop] = lambda head: None
) -> AsyncIterator[FaultProxy]:
    """A proxy to ``http://host:port`` for the duration of the block."""
    host, port = target_url.removeprefix("http://").rsplit(":", 1)
    proxy = FaultProxy(host, int(port), drop)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    proxy.url = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, proxy._handle)
            try:
                yield proxy
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()

"""A connection's phase deadlines (meshnet_runtime.phase_deadline): kept by
the server's watchdog under ``serve`` (no scope deadline moved per request),
by the connection's own scope without it; either way a slow head is a 408
and a long application phase is never cut."""

from __future__ import annotations

import json
import math

import anyio
import pytest

from meshnet_proto import ServerConnection
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.http_server import HttpServer, ServerSettings
from meshnet_runtime.phase_deadline import PhaseDeadline
from meshnet_runtime.transports import connect, memory_stream_pair
from support.serving import EchoApp, activation, at_eof, running
from support.waiting import wait_until
from support.wire import read_answer

SLOW_HEAD = b"POST /forward HTTP/1.1\r\nHost: t\r\n"  # never finished


class Clock:
    """A loop clock held still, far ahead of the loop's own: a deadline on it
    never passes by itself while a test runs."""

    def __init__(self, time: float) -> None:
        self.time = time

    def __call__(self) -> float:
        return self.time


@pytest.mark.anyio
async def test_unwatched_moves_its_scope_watched_only_writes_the_time_down() -> None:
    clock = Clock(anyio.current_time() + 1000)
    now = clock.time
    with anyio.CancelScope() as scope:
        own = PhaseDeadline(clock, watched=False, scope=scope)
        own.expire_in(5.0)
        assert (own.expires, scope.deadline) == (now + 5.0, now + 5.0)
        own.clear()
        assert (own.expires, scope.deadline) == (math.inf, math.inf)

        watched = PhaseDeadline(clock, watched=True, scope=scope)
        watched.expire_in(0.5)
        watched.clear()
        assert watched.expires == math.inf
        watched.expire_in(0.5)
        assert watched.expires == now + 0.5 and scope.deadline == math.inf
        watched.expire_if_due(now + 0.4)
        assert not scope.cancel_called
        watched.expire_if_due(now + 0.5)
        assert scope.cancel_called
        await anyio.lowlevel.checkpoint()  # the connection's next checkpoint ends it
    assert scope.cancelled_caught


def test_a_deadline_without_its_connection_running_cancels_nothing() -> None:
    ended = PhaseDeadline(Clock(0.0), watched=True, expires=0.0)
    ended.expire_if_due(1.0)  # scope None: the connection is gone
    assert ended.scope is None


def test_the_watchdog_looks_a_tenth_of_the_shortest_timeout_within_bounds() -> None:
    assert ServerSettings(head_timeout=0.3).watch_interval == pytest.approx(0.03)
    assert ServerSettings(head_timeout=10.0).watch_interval == 1.0  # the defaults: at most 1 s
    assert ServerSettings(write_timeout=0.001).watch_interval == 0.01  # at least 10 ms


@pytest.mark.anyio
async def test_a_listening_server_times_its_connections_by_its_watchdog() -> None:
    async with running(head_timeout=0.3) as (server, url):
        assert server.watching
        slow = await connect(parse_endpoint(url))
        await wait_until(lambda: server._connections, "the connection accepted")
        (connection,) = server._connections
        assert connection.deadline.watched
        scope = connection.deadline.scope
        assert scope is not None and scope.deadline == math.inf
        await slow.send(SLOW_HEAD)
        started = anyio.current_time()
        status, _, body = await read_answer(slow)
        waited = anyio.current_time() - started
        assert (status, json.loads(body)["error"]["code"]) == (408, "request_timeout")
        assert waited >= 0.3 - 0.05  # not before the head timeout
        assert await at_eof(slow)
    assert not server.watching  # the watchdog ends with the server


@pytest.mark.anyio
async def test_an_application_slower_than_the_head_timeout_is_not_cut() -> None:
    app = EchoApp()
    app.hold = True
    async with running(app, head_timeout=0.2) as (_, url):
        stream = await connect(parse_endpoint(url))
        await stream.send(activation())
        await app.entered.wait()
        await anyio.sleep(0.8)  # stall under test: four head timeouts, many watchdog looks
        app.release.set()
        assert (await read_answer(stream))[0] == 200
        await stream.send(activation())  # the connection goes on
        assert (await read_answer(stream))[0] == 200
        await stream.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("watchdog", [False, True], ids=["own-scope", "embedder-watchdog"])
async def test_a_stream_served_by_an_embedder_is_timed_either_way(watchdog: bool) -> None:
    server = HttpServer(
        EchoApp(), lambda: ServerConnection(), settings=ServerSettings(head_timeout=0.3)
    )
    client, served = memory_stream_pair()
    async with anyio.create_task_group() as tg:
        if watchdog:
            await tg.start(server.watch_deadlines)
        tg.start_soon(server.serve_stream, served)
        await client.send(activation())  # served at once, either way
        assert (await read_answer(client))[0] == 200
        await client.send(SLOW_HEAD)
        with anyio.fail_after(10):
            status, _, body = await read_answer(client)
        assert (status, json.loads(body)["error"]["code"]) == (408, "request_timeout")
        tg.cancel_scope.cancel()
    assert not server.watching

"""The userspace link emulator: its time model with made-up times, then the proxy
over real loopback sockets on both anyio backends — delay, rate, order under
jitter, byte counters, failures on either side — and its command line.

The timing tests are about time by design (a ping-pong takes twice the delay,
a bulk transfer runs at the rate, each within 10 %): they take medians, use
delays that dwarf loopback's own cost and wait on events, never on sleeps.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import select
import socket
import statistics
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

from meshnet_bench.emulated_link import (
    PROFILES,
    EmulatedLink,
    LinkProfile,
    LinkSchedule,
    QueuedBytes,
)

Handler = Callable[[SocketStream], Awaitable[None]]
NO_SHAPING = PROFILES["loopback"]


@asynccontextmanager
async def serving(handler: Handler, port: int = 0) -> AsyncIterator[int]:
    """Serve ``handler`` on a loopback port (0: a free one) for the block; yield the port."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler, tg)
        try:
            yield listener.extra(SocketAttribute.local_port)
        finally:
            tg.cancel_scope.cancel()


async def echo(stream: SocketStream) -> None:
    """Send back what comes, then the end of stream."""
    async with stream:
        async for piece in stream:
            await stream.send(piece)
        await stream.send_eof()


async def receive_all(stream: SocketStream) -> bytes:
    return b"".join([piece async for piece in stream])


# -- the time model, with made-up times -------------------------------------------------------


def release(schedule: LinkSchedule, arrival: float, size: int) -> float:
    """A piece taken onto the link as soon as the link is free: its release time."""
    return schedule.propagate(schedule.serialize(arrival, size))


def test_without_a_rate_each_piece_arrives_after_the_delay() -> None:
    schedule = LinkSchedule(LinkProfile(delay_s=0.005, rate_bps=None), random.Random(0))
    assert schedule.serialize(1.0, 10**6) == 1.0
    assert schedule.propagate(1.0) == pytest.approx(1.005)
    assert release(schedule, 1.0, 1) == pytest.approx(1.005)
    assert release(schedule, 2.0, 0) == pytest.approx(2.005)  # an end of stream too


def test_pieces_queue_at_the_bottleneck_then_propagate() -> None:
    # 1,000 bytes at 8 Mbit/s: 1 ms on the link each.
    schedule = LinkSchedule(LinkProfile(delay_s=0.010, rate_bps=8e6), random.Random(0))
    assert [schedule.serialize(0.0, 1000) for _ in range(3)] == pytest.approx([0.001, 0.002, 0.003])
    assert schedule.propagate(0.003) == pytest.approx(0.013)  # the delay comes after
    # An idle link serializes a piece from its arrival, not from the last one's end.
    assert release(schedule, 0.5, 1000) == pytest.approx(0.511)
    assert schedule.serialize(0.5, 0) == pytest.approx(0.501)  # an end of stream waits its turn


def test_jitter_spreads_pieces_but_never_reorders_them() -> None:
    profile = LinkProfile(delay_s=0.005, rate_bps=None, jitter_s=0.010)
    arrivals = [k * 0.001 for k in range(200)]  # 1 ms apart: 10 ms of jitter would reorder
    schedule = LinkSchedule(profile, random.Random(7))
    releases = [release(schedule, t, 100) for t in arrivals]
    assert releases == sorted(releases)
    for arrival, released in zip(arrivals, releases, strict=True):
        assert arrival + 0.005 <= released <= arrival + 0.015 + 1e-12
    assert len({round(r - a, 9) for a, r in zip(arrivals, releases, strict=True)}) > 100
    again = LinkSchedule(profile, random.Random(7))
    assert [release(again, t, 100) for t in arrivals] == releases  # seeded: repeatable


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"delay_s": -0.001}, "delay_s must be a finite number of seconds >= 0"),
        ({"delay_s": math.nan}, "delay_s must be"),
        ({"delay_s": math.inf}, "delay_s must be"),
        ({"jitter_s": -1.0}, "jitter_s must be"),
        ({"jitter_s": math.nan}, "jitter_s must be"),
        ({"rate_bps": 0.0}, "rate_bps must be a finite number > 0 or None"),
        ({"rate_bps": -8e6}, "rate_bps must be"),
        ({"rate_bps": math.nan}, "rate_bps must be"),
        ({"rate_bps": math.inf}, "rate_bps must be"),
    ],
)
def test_a_profile_refuses_what_no_link_does(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(NO_SHAPING, **fields)


def test_the_named_profiles() -> None:
    assert dict(PROFILES) == {
        "loopback": LinkProfile(delay_s=0.0, rate_bps=None),
        "lan": LinkProfile(delay_s=0.25e-3, rate_bps=1e9),
        "wifi": LinkProfile(delay_s=5e-3, rate_bps=100e6),
        "wan": LinkProfile(delay_s=20e-3, rate_bps=50e6),
    }
    assert PROFILES["wifi"].describe() == "5 ms, 100 Mbit/s"
    with pytest.raises(TypeError):
        PROFILES["wan"] = NO_SHAPING  # type: ignore[index]  # read-only, shared by every bench


@pytest.mark.anyio
async def test_the_queue_holds_back_its_reader_by_bytes() -> None:
    queued = QueuedBytes(100)
    await queued.take(60)
    await queued.take(40)
    taken = anyio.Event()

    async def take_one_more() -> None:
        await queued.take(1)
        taken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take_one_more)
        await anyio.wait_all_tasks_blocked()
        assert not taken.is_set()  # full: the reader waits
        queued.give_back(60)
        with anyio.fail_after(5):
            await taken.wait()
    assert queued.held == 41
    oversized = QueuedBytes(10)
    with anyio.fail_after(5):
        await oversized.take(1000)  # larger than the limit, but the queue was empty


# -- the proxy, over loopback sockets -----------------------------------------------------------


@asynccontextmanager
async def linked(handler: Handler, **shaping: Any) -> AsyncIterator[EmulatedLink]:
    """``handler`` served on loopback behind an emulated link for the block."""
    async with serving(handler) as port, EmulatedLink.serving("127.0.0.1", port, **shaping) as link:
        yield link


async def connect(link: EmulatedLink) -> SocketStream:
    return await anyio.connect_tcp("127.0.0.1", link.port)


@pytest.mark.anyio
async def test_a_ping_pong_takes_both_one_way_delays() -> None:
    up, down = LinkProfile(delay_s=0.030, rate_bps=None), LinkProfile(delay_s=0.020, rate_bps=1e9)
    arrivals: list[float] = []

    async def stamp_and_echo(stream: SocketStream) -> None:
        async with stream:
            async for piece in stream:
                arrivals.append(anyio.current_time())
                await stream.send(piece)

    ups, downs = [], []
    async with linked(stamp_and_echo, up=up, down=down) as link, await connect(link) as client:
        for _ in range(20):
            sent = anyio.current_time()
            await client.send(b"x")
            assert await client.receive() == b"x"
            ups.append(arrivals[-1] - sent)
            downs.append(anyio.current_time() - arrivals[-1])
    round_trip = statistics.median(u + d for u, d in zip(ups, downs, strict=True))
    assert round_trip == pytest.approx(0.050, rel=0.10), (ups, downs)
    # Each direction its own delay, a few tenths of a millisecond late (waking up).
    assert statistics.median(ups) == pytest.approx(0.030, abs=0.003), ups
    assert statistics.median(downs) == pytest.approx(0.020, abs=0.003), downs


BULK_BYTES = 2_000_000
BULK_RATE = 40e6  # bits per second: 2 MB take 0.4 s
AT_BULK_RATE = LinkProfile(delay_s=0.0, rate_bps=BULK_RATE)


def counting_sink(ends: list[float], expected: int) -> Handler:
    """A server that reads to the end of stream and notes when it got there."""

    async def count(stream: SocketStream) -> None:
        async with stream:
            assert len(await receive_all(stream)) == expected
            ends.append(anyio.current_time())

    return count


async def upload(link: EmulatedLink, size: int) -> None:
    async with await connect(link) as client:
        await client.send(bytes(size))
        await client.send_eof()
        with pytest.raises(anyio.EndOfStream):  # the sink closes once it has read it all
            await client.receive()


@pytest.mark.anyio
async def test_a_bulk_upload_runs_at_the_rate() -> None:
    ends: list[float] = []
    async with linked(counting_sink(ends, BULK_BYTES), up=AT_BULK_RATE, down=NO_SHAPING) as link:
        started = anyio.current_time()
        with anyio.fail_after(10):
            await upload(link, BULK_BYTES)
    rate = BULK_BYTES * 8 / (ends[0] - started)
    assert rate == pytest.approx(BULK_RATE, rel=0.10)


@pytest.mark.anyio
async def test_a_bulk_download_runs_at_the_rate() -> None:
    starts: list[float] = []

    async def pour(stream: SocketStream) -> None:
        async with stream:
            starts.append(anyio.current_time())
            await stream.send(bytes(BULK_BYTES))

    async with (
        linked(pour, up=NO_SHAPING, down=AT_BULK_RATE) as link,
        await connect(link) as client,
    ):
        with anyio.fail_after(10):
            assert len(await receive_all(client)) == BULK_BYTES
        ended = anyio.current_time()
    rate = BULK_BYTES * 8 / (ended - starts[0])
    assert rate == pytest.approx(BULK_RATE, rel=0.10)


@pytest.mark.anyio
async def test_connections_at_once_share_the_rate() -> None:
    # One bottleneck per direction: two uploads of half the bytes at once take
    # as long as one of all of them, not half as long.
    ends: list[float] = []
    half = BULK_BYTES // 2
    async with linked(counting_sink(ends, half), up=AT_BULK_RATE) as link:
        started = anyio.current_time()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(upload, link, half)
                tg.start_soon(upload, link, half)
    rate = BULK_BYTES * 8 / (max(ends) - started)
    assert rate == pytest.approx(BULK_RATE, rel=0.10)
    assert link.bytes_up == BULK_BYTES


@pytest.mark.anyio
async def test_jitter_keeps_the_bytes_in_order_and_intact() -> None:
    jittery = LinkProfile(delay_s=0.001, rate_bps=None, jitter_s=0.010)
    records = [k.to_bytes(4, "big") + bytes([k % 256]) * (k % 50 + 1) for k in range(100)]
    sent = b"".join(records)

    async def send_records(client: SocketStream) -> None:
        for record in records:
            await client.send(record)
            # Spaced so that the link reads them as separate pieces, each with
            # its own draw of jitter (up to 10 ms, ten times the spacing).
            await anyio.sleep(0.001)  # stall under test: records spaced apart
        await client.send_eof()

    async with (
        linked(echo, up=jittery, seed=3) as link,
        await connect(link) as client,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(send_records, client)
        with anyio.fail_after(10):
            back = await receive_all(client)
    assert back == sent
    assert link.bytes_up == link.bytes_down == len(sent)


@pytest.mark.anyio
async def test_the_byte_counters_add_up_over_connections() -> None:
    async def answer_a_third(stream: SocketStream) -> None:
        async with stream:
            await stream.send(bytes(len(await receive_all(stream)) // 3 + 7))

    async with linked(answer_a_third, up=PROFILES["wan"]) as link:
        assert (link.bytes_up, link.bytes_down, link.connections) == (0, 0, 0)
        for size, total_up, total_down in [(300_001, 300_001, 100_007), (5, 300_006, 100_015)]:
            async with await connect(link) as client:
                await client.send(bytes(size))
                await client.send_eof()
                assert len(await receive_all(client)) == size // 3 + 7
            # Read while the link runs: a bench reads them between its rounds.
            assert (link.bytes_up, link.bytes_down) == (total_up, total_down)
        assert link.connections == 2
        assert link.host_port == f"127.0.0.1:{link.port}"
        assert link.url_for("/v1/forward") == f"http://127.0.0.1:{link.port}/v1/forward"
        assert link.url_for() == f"http://127.0.0.1:{link.port}"


@pytest.mark.anyio
async def test_a_retuned_link_shapes_the_next_pieces_by_its_new_profile() -> None:
    async def round_trips(client: SocketStream) -> list[float]:
        times = []
        for _ in range(5):
            sent = anyio.current_time()
            await client.send(b"x")
            assert await client.receive() == b"x"
            times.append(anyio.current_time() - sent)
        return times

    async with linked(echo) as link, await connect(link) as client:
        assert statistics.median(await round_trips(client)) < 0.020  # loopback: no delay
        link.retune(LinkProfile(delay_s=0.010, rate_bps=None))
        assert min(await round_trips(client)) >= 0.020  # never early: a delay is a floor
        link.retune(NO_SHAPING, down=LinkProfile(delay_s=0.015, rate_bps=None))
        assert min(await round_trips(client)) >= 0.015


@pytest.mark.anyio
async def test_a_small_queue_still_carries_pieces_larger_than_itself() -> None:
    payload = random.Random(1).randbytes(300_000)
    async with (
        linked(echo, up=PROFILES["lan"], max_queued_bytes=1000) as link,
        await connect(link) as client,
    ):
        await client.send(payload)
        await client.send_eof()
        with anyio.fail_after(10):
            assert await receive_all(client) == payload


@pytest.mark.anyio
async def test_a_refusing_target_closes_the_client_and_the_link_serves_on() -> None:
    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = target.getsockname()[1]
        async with EmulatedLink.serving("127.0.0.1", port) as link:
            async with await connect(link) as client:
                with anyio.fail_after(10), pytest.raises(anyio.EndOfStream):
                    await client.receive()
            target.close()  # never connected: its port is free again at once
            async with serving(echo, port), await connect(link) as client:
                await client.send(b"again")
                assert await client.receive() == b"again"
            assert link.connections == 2


@pytest.mark.anyio
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_client_leaving_mid_transfer_closes_its_pair_only(reset: bool) -> None:
    ended: list[anyio.Event] = []

    async def pour_until_closed(stream: SocketStream) -> None:
        ended.append(anyio.Event())
        async with stream:
            with pytest.raises(anyio.BrokenResourceError):
                while True:
                    await stream.send(bytes(64 * 1024))
        ended[-1].set()

    async with linked(pour_until_closed, down=PROFILES["wifi"]) as link:
        async with await connect(link) as client:
            assert len(await client.receive()) > 0
            if reset:  # an abortive close: the proxy reads a reset, not an end of stream
                raw = client.extra(SocketAttribute.raw_socket)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with anyio.fail_after(10):
            await ended[0].wait()  # the proxy closed the target's side too
        async with await connect(link) as client:
            asked = anyio.current_time()
            assert len(await client.receive()) > 0  # the next connection is carried
            # ... at once: the bytes the first one left queued (16 MiB, over a
            # second of this link) left with it and hold no one up.
            assert anyio.current_time() - asked < 0.5
        assert link.connections == 2


@pytest.mark.anyio
async def test_an_error_in_the_block_leaves_as_itself() -> None:
    with pytest.raises(LookupError, match="the caller's own"):
        async with EmulatedLink.serving("127.0.0.1", 9):
            raise LookupError("the caller's own")


# -- the command line ---------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "meshnet_bench.emulated_link", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--target", "127.0.0.1:8000", "--delay-ms", "-1"], "--delay-ms: expected a number >= 0"),
        (["--target", "127.0.0.1:8000", "--rate-mbit", "0"], "--rate-mbit: expected a number > 0"),
        (["--target", "127.0.0.1:8000", "--jitter-ms", "nan"], "--jitter-ms: expected a finite"),
        (["--target", "8000"], "--target: expected HOST:PORT, got '8000'"),
        (["--target", "127.0.0.1:1", "--profile", "moon"], "--profile: invalid choice: 'moon'"),
        ([], "the following arguments are required: --target"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(args: list[str], names: str) -> None:
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and names in done.stderr, done.stderr


def test_a_taken_port_is_one_line_and_exit_2(taken_port: int) -> None:
    done = run_cli("--listen", f"127.0.0.1:{taken_port}", "--target", "127.0.0.1:1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{taken_port}" in done.stderr


def test_the_command_prints_its_ready_line_and_forwards() -> None:
    with socket.create_server(("127.0.0.1", 0)) as target:
        target_port = target.getsockname()[1]
        flags = ["--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{target_port}"]
        command = [sys.executable, "-m", "meshnet_bench.emulated_link", *flags, "--profile", "wifi"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, "no ready line within 60 s"
            line = proc.stdout.readline()
            match = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)\n", line)
            assert match, line
            with socket.create_connection(("127.0.0.1", int(match[1])), timeout=10) as client:
                target.settimeout(10)
                carried, _ = target.accept()
                with carried:
                    client.sendall(b"by hand")
                    carried.settimeout(10)
                    assert carried.recv(100, socket.MSG_WAITALL) == b"by hand"
        finally:
            proc.terminate()
            proc.wait(timeout=10)

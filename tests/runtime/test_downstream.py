"""The downstream pool: failures name the hop, stale connections retry once."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from anyio.abc import SocketAttribute

from meshnet_proto import ActivationResponse, DownstreamError, ErrorResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.gateway import closed_port_url
from support.waiting import wait_until

SID = "5b1e0c4e-8d8a-4c55-9d6e-1f2a3b4c5d6e"
HEADERS = WireHeaders(shape=(1, 4), dtype="float32", session=SID, chunk_index=0, chunk_total=1,
                      position=0)  # fmt: skip
BODY = np.arange(4, dtype="<f4").tobytes()
OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nX-Meshnet-Wire: 2\r\n"
    b"X-Meshnet-Shape: 1,4\r\nX-Meshnet-Dtype: float32\r\nX-Meshnet-Session: " + SID.encode()
    + b"\r\nX-Meshnet-Chunk-Index: 0\r\nX-Meshnet-Chunk-Total: 1\r\nX-Meshnet-Position: 0\r\n"
    b"Content-Length: 16\r\n\r\n" + BODY
)  # fmt: skip


class Closes:
    """The connections a fake downstream has closed on its side: once one is
    counted its FIN is on its way over loopback, what a test waits for."""

    count = 0


async def fake_downstream(
    tg: anyio.abc.TaskGroup, answer, *, close_after: bool = False, closes: Closes | None = None
) -> str:
    """A TCP server answering each request with ``answer`` (bytes, or None = never)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        try:
            async with stream:
                buf = b""
                try:
                    while True:
                        buf += await stream.receive()
                        while b"\r\n\r\n" in buf:
                            head, _, rest = buf.partition(b"\r\n\r\n")
                            length = 0
                            for line in head.split(b"\r\n"):
                                if line.lower().startswith(b"content-length:"):
                                    length = int(line.split(b":")[1])
                            if len(rest) < length:
                                break
                            buf = rest[length:]
                            if answer is None:
                                await anyio.sleep_forever()
                            await stream.send(answer)
                            if close_after:
                                return
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
        finally:  # its side closed, whichever way the exchange ended
            if closes is not None:
                closes.count += 1

    tg.start_soon(listener.serve, handle)
    return f"http://127.0.0.1:{port}"


async def free_port_url() -> str:
    """A loopback URL nobody listens on, its port held bound (support.gateway)."""
    return closed_port_url()


@pytest.mark.anyio
async def test_reuses_one_connection() -> None:
    async with anyio.create_task_group() as tg:
        url = await fake_downstream(tg, OK)
        pool = DownstreamPool(url)
        for _ in range(3):
            response = await pool.forward(HEADERS, BODY, Deadline.after(10))
            assert isinstance(response, ActivationResponse)
            assert response.tensor is None and bytes(response.body) == BODY
        assert pool.idle_connections == 1
        await pool.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_down_is_502_naming_the_hop_quickly() -> None:
    url = await free_port_url()
    pool = DownstreamPool(url)
    with anyio.fail_after(5), pytest.raises(DownstreamError) as exc:
        await pool.forward(HEADERS, BODY, Deadline.after(30))
    assert (exc.value.status, exc.value.code, exc.value.hop) == (502, "downstream_unreachable", url)


@pytest.mark.anyio
async def test_silent_downstream_is_504_at_the_deadline() -> None:
    async with anyio.create_task_group() as tg:
        url = await fake_downstream(tg, None)
        pool = DownstreamPool(url)
        with pytest.raises(DownstreamError) as exc:
            await pool.forward(HEADERS, BODY, Deadline.after(0.3))
        assert (exc.value.status, exc.value.code, exc.value.hop) == (504, "downstream_timeout", url)
        assert not pool.idle_connections  # a timed-out connection is never reused
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_garbage_is_502_bad_response() -> None:
    async with anyio.create_task_group() as tg:
        url = await fake_downstream(tg, b"SSH-2.0-OpenSSH\r\n\r\n")
        with pytest.raises(DownstreamError) as exc:
            await DownstreamPool(url).forward(HEADERS, BODY, Deadline.after(10))
        assert (exc.value.code, exc.value.hop) == ("downstream_bad_response", url)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_error_answer_is_returned_for_the_caller_to_relay() -> None:
    error = (
        b'{"error":{"status":409,"code":"position_mismatch","message":"m",'
        b'"header":null,"hop":null}}'
    )
    answer = (
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(error)).encode() + b"\r\n\r\n" + error
    )  # fmt: skip
    async with anyio.create_task_group() as tg:
        url = await fake_downstream(tg, answer)
        response = await DownstreamPool(url).forward(HEADERS, BODY, Deadline.after(10))
        assert isinstance(response, ErrorResponse)
        relayed = response.to_error(hop=url)
        assert (relayed.status, relayed.code, relayed.hop) == (409, "position_mismatch", url)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_stale_pooled_connection_is_retried_once() -> None:
    async with anyio.create_task_group() as tg:
        # Answers, then closes without "Connection: close": the pooled
        # connection is dead by the time the next request uses it.
        closes = Closes()
        url = await fake_downstream(tg, OK, close_after=True, closes=closes)
        pool = DownstreamPool(url)
        for sent in range(1, 4):
            response = await pool.forward(HEADERS, BODY, Deadline.after(10))
            assert isinstance(response, ActivationResponse)
            await wait_until(lambda: closes.count == sent, "the server's close")  # noqa: B023
        # A request that is not safe to repeat is not retried.
        unsafe = HEADERS.replace(position=None)
        with pytest.raises(DownstreamError) as exc:
            await pool.forward(unsafe, BODY, Deadline.after(10))
        assert exc.value.code == "downstream_unreachable"
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_retry_uses_a_new_connection_not_another_stale_one() -> None:
    # A server closes every idle keep-alive connection at its head timeout, so
    # when one pooled connection is stale its idle siblings usually are too:
    # retrying on the next pooled one was a 502 for a healthy downstream.
    async with anyio.create_task_group() as tg:
        closes = Closes()
        url = await fake_downstream(tg, OK, close_after=True, closes=closes)
        pool = DownstreamPool(url)
        answers: list[object] = []

        async def one() -> None:
            answers.append(await pool.forward(HEADERS, BODY, Deadline.after(10)))

        async with anyio.create_task_group() as burst:
            for _ in range(3):
                burst.start_soon(one)
        assert pool.idle_connections == 3  # three pooled, all about to go stale
        await wait_until(lambda: closes.count == 3, "the server's closes")
        response = await pool.forward(HEADERS, BODY, Deadline.after(10))
        assert isinstance(response, ActivationResponse)
        assert all(isinstance(a, ActivationResponse) for a in answers)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_spent_deadline_is_504_before_sending() -> None:
    pool = DownstreamPool("http://127.0.0.1:9")
    with pytest.raises(DownstreamError) as exc:
        await pool.forward(HEADERS, BODY, Deadline(anyio.current_time() - 1))
    assert (exc.value.status, exc.value.code, exc.value.hop) == (504, "deadline_exceeded", None)


@pytest.mark.anyio
@pytest.mark.parametrize("expiry, reused", [(0.05, False), (60.0, True)])
async def test_a_connection_idle_past_the_expiry_is_not_reused(expiry: float, reused: bool) -> None:
    # A chunk without session and position may not be retried (it is not a
    # replay), so a pooled connection the server closed at its idle timeout
    # would fail it: the pool lets connections go before servers do.
    unsafe = HEADERS.replace(session=None, position=None)
    async with anyio.create_task_group() as tg:
        closes = Closes()
        url = await fake_downstream(tg, OK, close_after=True, closes=closes)
        pool = DownstreamPool(url, keepalive_expiry=expiry)
        assert isinstance(await pool.forward(unsafe, BODY, Deadline.after(10)), ActivationResponse)
        assert pool.idle_connections == 1
        await wait_until(lambda: closes.count == 1, "the server's close")
        if not reused:
            await anyio.sleep(expiry)  # stall under test: idle past the pool's expiry
        if reused:
            with pytest.raises(DownstreamError) as exc:
                await pool.forward(unsafe, BODY, Deadline.after(10))
            assert exc.value.code == "downstream_unreachable"
        else:
            answer = await pool.forward(unsafe, BODY, Deadline.after(10))
            assert isinstance(answer, ActivationResponse)
        await pool.aclose()
        tg.cancel_scope.cancel()

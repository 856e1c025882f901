"""Correctness red flags found reading the runtime (issue 12), one test each.

Each test failed before its fix: work that blocked the event loop, an
error that turned into a 500, a budget that undercounted, a client that
half-closed losing its answer, a waiter left registered, a deadline the
body read ignored, and a failure swallowed without a word.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import anyio
import numpy as np
import pytest

import meshnet_runtime.codec_pool as codec_pool_module
from meshnet_gateway._pipeline import run_chunks
from meshnet_node import serve_node
from meshnet_node.app import NodeApp
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationReceived, ProtocolError, WireHeaders
from meshnet_proto._budget import request_cost
from meshnet_proto._chunking import ChunkAssembler
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.http_server import (
    HttpServer,
    Reply,
    RequestContext,
    ServerSettings,
)
from meshnet_runtime.transports import connect, listen
from meshnet_runtime.wire_encoder import WireEncoder
from support.gateway import chain as gateway_chain
from support.wire import exchange, forward_request, http_request, read_answer

pytestmark = pytest.mark.anyio

QUIET = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]


def floats(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(3).standard_normal(shape).astype(np.float32)


def wire_fields(shape: tuple[int, ...], session: str, **extra: str) -> dict[str, str]:
    return {
        "X-Meshnet-Shape": ",".join(map(str, shape)),
        "X-Meshnet-Dtype": "float32",
        "X-Meshnet-Session": session,
        "X-Meshnet-Chunk-Index": "0",
        "X-Meshnet-Chunk-Total": "1",
        **extra,
    }


# ------------------------------------------------- work that blocked the loop


async def test_joining_a_large_run_happens_off_the_event_loop(monkeypatch: Any) -> None:
    """The gateway's reassembly copies the whole output (up to 512 MiB): it
    must run in a worker thread, not stall every other request."""
    loop_thread = threading.get_ident()
    joined_on: list[int] = []
    original = ChunkAssembler.result

    def result(self: ChunkAssembler) -> np.ndarray:
        joined_on.append(threading.get_ident())
        return original(self)

    monkeypatch.setattr(ChunkAssembler, "result", result)
    async with gateway_chain(1) as c:
        pool = DownstreamPool(parse_endpoint(c.entry))
        try:
            encoder = WireEncoder(CodecPool(), encoding="identity")
            out = await run_chunks(
                pool, encoder, floats((1, 1024, 128)), session=str(uuid.uuid4()),
                base_position=0, chunk_tokens=256, inflight=2, deadline=Deadline.after(20),
            )  # fmt: skip
        finally:
            await pool.aclose()
    assert out.output.shape == (1, 1024, 128)
    assert joined_on and loop_thread not in joined_on


async def test_a_strided_chunk_is_made_contiguous_off_the_loop(monkeypatch: Any) -> None:
    """A chunk view of a batch > 1 tensor is strided: its "trivial" identity
    encode is a full copy, and a large one must leave the loop; a
    contiguous one is a zero-copy view and stays inline."""
    loop_thread = threading.get_ident()
    encoded_on: list[int] = []
    # The pool encodes through encode_for_wire, or at once through
    # encode_tensor when trivial: each is watched for the thread it runs on.
    for name in ("encode_for_wire", "encode_tensor"):
        original = getattr(codec_pool_module, name)

        def encode(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            encoded_on.append(threading.get_ident())
            return _original(*args, **kwargs)

        monkeypatch.setattr(codec_pool_module, name, encode)
    codecs = CodecPool()
    batch = floats((2, 1024, 256))  # 2 MiB
    strided = batch[:, :512]  # what plan_chunks cuts: 1 MiB, not contiguous
    assert not strided.flags.c_contiguous
    _, _, body = await codecs.encode(strided, encoding_policy="identity")
    assert bytes(body) == strided.tobytes()
    assert encoded_on == [encoded_on[0]] and encoded_on[0] != loop_thread

    encoded_on.clear()
    await codecs.encode(batch[:1], encoding_policy="identity")
    assert encoded_on == [loop_thread]  # a view: no copy, no thread hop


# ------------------------------------------------ errors that became a 500


class _FailingEncodes(CodecPool):
    """Encodes the first chunk, then refuses (as a MeshnetError would)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def encode(self, array: np.ndarray, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise ProtocolError("cannot encode this chunk", code="bad_tensor", status=422)
        return await super().encode(array, **kwargs)


async def test_an_error_in_the_senders_own_loop_is_the_error_not_a_group() -> None:
    """An error raised while run_chunks prepares a chunk (not in a chunk's
    task) comes out as itself, so callers' ``except MeshnetError`` answers it."""
    encoder = WireEncoder(_FailingEncodes(), encoding="identity")
    async with gateway_chain(1) as c:
        pool = DownstreamPool(parse_endpoint(c.entry))
        try:
            with pytest.raises(ProtocolError) as caught:
                await run_chunks(
                    pool, encoder, floats((1, 64, 8)), session=str(uuid.uuid4()),
                    base_position=0, chunk_tokens=16, inflight=1, deadline=Deadline.after(20),
                )  # fmt: skip
        finally:
            await pool.aclose()
    assert caught.value.code == "bad_tensor"


# ------------------------------------------------------ the memory budget


def test_a_relaying_node_counts_what_it_holds_not_the_request_alone() -> None:
    """A relaying node holds the request, its stage output (kept for a
    reforward) and the downstream's answer: about three tensors."""
    headers = WireHeaders(shape=(1, 256, 1024), dtype="float32", encoding="identity")
    assert request_cost(headers) == headers.nbytes
    assert request_cost(headers, relaying=True) == 3 * headers.nbytes
    zstd = headers.replace(encoding="zstd")
    assert request_cost(zstd, relaying=True) == request_cost(zstd) + 2 * headers.nbytes


async def test_a_relaying_nodes_budget_reserves_three_tensors() -> None:
    array = floats((1, 64, 256))
    async with gateway_chain(2) as c:
        first, last = c.nodes
        request = forward_request(wire_fields(array.shape, str(uuid.uuid4())), array.tobytes())
        answer = await exchange(first.url, request)
        assert answer.status == 200, answer.body
        assert first.server.budget is not None and last.server.budget is not None
        assert first.server.budget.peak == 3 * array.nbytes
        assert last.server.budget.peak == array.nbytes


# ----------------------------------------------------------- the half-close


class _SlowApp:
    """Answers /slow after a little work; asks to be cancelled when the client leaves."""

    def __init__(self) -> None:
        self.cancelled = False

    async def handle_activation_head(self, event: Any, ctx: RequestContext) -> None:
        raise AssertionError("no activations here")

    async def handle_activation(self, event: Any, ctx: RequestContext) -> Reply:
        raise AssertionError("no activations here")

    def cancel_on_disconnect(self, event: Any) -> bool:
        return True

    async def handle_endpoint(self, event: Any, ctx: RequestContext) -> Reply:
        try:
            # A slow answer: the client's half-close arrives while it works.
            await anyio.sleep(0.3)  # stall under test
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        return Reply.json(200, {"done": True})


async def _serving(app: Any, **settings: float) -> tuple[HttpServer, Any]:
    from meshnet_proto import ServerConnection

    server = HttpServer(app, ServerConnection, settings=ServerSettings(**settings))
    return server, await listen(host="127.0.0.1", port=0)


async def test_a_half_close_after_a_whole_request_still_gets_its_answer() -> None:
    """``shutdown(SHUT_WR)`` after a complete request says "nothing more
    from me", not "I left": the answer must still come."""
    app = _SlowApp()
    server, bound = await _serving(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        answer = await exchange(url, http_request("GET", "/info"), half_close=True)
        server.request_shutdown()
    assert (answer.status, answer.body) == (200, b'{"done":true}')
    assert not app.cancelled


async def test_a_client_that_closes_for_good_still_cancels_the_work() -> None:
    """The other side of the half-close: a client that closed its socket
    is found out (the interim probe meets a reset) and the handler cancelled."""

    class Endless(_SlowApp):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.gone = anyio.Event(), anyio.Event()

        async def handle_endpoint(self, event: Any, ctx: RequestContext) -> Reply:
            self.entered.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled = True
                self.gone.set()
                raise
            raise AssertionError  # pragma: no cover

    app = Endless()
    server, bound = await _serving(app)
    async with anyio.create_task_group() as tg:
        url = await tg.start(server.serve, bound)
        stream = await connect(parse_endpoint(url))
        await stream.send(http_request("GET", "/info"))
        with anyio.fail_after(20):  # ends a hang; not a timing claim
            await app.entered.wait()  # the work is under way
            await stream.aclose()
            await app.gone.wait()
        server.request_shutdown()


# ------------------------------------------------------ a cancelled waiter


def _chunk_one(session: str) -> ActivationReceived:
    headers = WireHeaders(shape=(1, 2), dtype="float32", session=session, chunk_index=1,
                          chunk_total=2, encoding="identity", position=2)  # fmt: skip
    return ActivationReceived(headers=headers, tensor=np.zeros((1, 2), np.float32), body_nbytes=8)


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    """A request cancelled while its chunk waits for its turn must leave the
    table: otherwise each one holds a place among the pending waiters for
    ever, and after a few no new session can start out of order."""
    app = NodeApp(NodeConfig.load(["--reorder-window", "2"]))
    assert app.table.max_pending_waiters == 8
    for _ in range(app.table.max_pending_waiters + 1):
        event = _chunk_one(str(uuid.uuid4()))
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                ctx = RequestContext(started=anyio.current_time(), path="/forward")
                tg.start_soon(app.handle_activation, event, ctx)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
    # Room for one more chunk of a session that has not started: not 503.
    app.table.check_head(_chunk_one(str(uuid.uuid4())).headers, anyio.current_time())


# -------------------------------------------------- the body-read deadline


async def test_a_body_slower_than_the_requests_deadline_is_504_at_the_deadline() -> None:
    """The body read is bounded by X-Meshnet-Deadline-Ms too, not only by
    the server's own (here: an hour-long) body timeout."""
    async with serve_node(NodeConfig.load([*QUIET, "--timeout", "3600"])) as node:
        fields = wire_fields((1, 1024), str(uuid.uuid4()), **{"X-Meshnet-Deadline-Ms": "200"})
        head = forward_request(fields, bytes(4096))[:-4000]  # most of the body missing
        stream = await connect(parse_endpoint(node.url))
        try:
            await stream.send(head)
            answer = await read_answer(stream, limit=30)
        finally:
            await stream.aclose()
    assert answer.status == 504, answer.body
    assert b"deadline_exceeded" in answer.body


# ------------------------------------------------ failures nobody heard of


class _BrokenClose:
    """A stream whose close fails with a bug (not a peer going away)."""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        raise anyio.EndOfStream

    async def send(self, item: bytes) -> None:
        raise anyio.BrokenResourceError

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        raise RuntimeError("a bug in aclose")


async def test_a_bug_while_closing_a_stream_is_logged_not_swallowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, bound = await _serving(_SlowApp())
    await bound.aclose()
    with caplog.at_level(logging.WARNING):
        await server.serve_stream(_BrokenClose())  # type: ignore[arg-type]
    assert any("a bug in aclose" in r.getMessage() or (r.exc_info and "a bug in aclose" in
               str(r.exc_info[1])) for r in caplog.records)  # fmt: skip

"""The one chain sender: a run of chunks through a chain, up to N in flight.

Used by the gateway's ``/forward`` (``app.py``), the client API's
``forward_via_chain`` and the OpenAI generation (``openai/generation.py``):
each cuts a sequence with ``plan_chunks``, sends chunk k with session,
index, total and position = base + offset, and takes the last node's
answers. What is valid on the wire is decided by ``meshnet_proto``; this
module only owns the concurrency: encode the next chunk while earlier ones
are downstream, keep at most ``inflight`` chunks on the wire, retry a chunk
whose failure ``RetryPolicy`` calls safe to retry (wire-2 §3 replay makes the
identical retransmission harmless), and turn the first failure into one
error after cancelling the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc
import numpy as np

from meshnet_proto import DownstreamError, ErrorCode, ErrorResponse, MeshnetError, WireHeaders
from meshnet_proto.lowlevel import ChunkAssembler, plan_chunks
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream
from meshnet_runtime.wire_encoder import WireEncoder

from ._retry import RetryPolicy, send_with_retries

__all__ = ["ChunkResult", "RunResult", "check_response", "run_chunks"]

log = logging.getLogger("meshnet.gateway")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkResult:
    """What one chunk cost: sent and received headers, bytes, wall time."""

    request: WireHeaders  # as sent (without the deadline, set at write time)
    response: WireHeaders  # the last node's answer
    raw_bytes: int  # decoded size of the chunk sent
    sent_bytes: int  # request body bytes on the wire
    received_bytes: int  # response body bytes on the wire
    seconds: float  # encode + round trip + decode (not time spent waiting for a slot)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    output: np.ndarray
    chunks: list[ChunkResult]


def _mismatch(pool: Downstream, index: int, what: str) -> DownstreamError:
    return DownstreamError(
        f"{pool.url}: answer to chunk {index} {what}",
        code=ErrorCode.DOWNSTREAM_BAD_RESPONSE,
        hop=pool.url,
    )


def check_response(pool: Downstream, sent: WireHeaders, got: WireHeaders) -> None:
    """The answer must describe the chunk we sent; a relay mixing up answers
    would otherwise corrupt the output silently."""
    index = sent.chunk_index
    assert index is not None
    for name in ("session", "chunk_index", "chunk_total", "position"):
        mine, theirs = getattr(sent, name), getattr(got, name)
        if theirs is not None and theirs != mine:
            raise _mismatch(pool, index, f"says {name.replace('_', '-')} {theirs}, not {mine}")


async def run_chunks(
    pool: Downstream,
    encoder: WireEncoder,
    array: np.ndarray,
    *,
    session: str,
    base_position: int,
    chunk_tokens: int,
    session_key: str | None = None,
    inflight: int,
    deadline: Deadline,
    request_encoding: str = "identity",
    relay: Callable[[ErrorResponse, str], MeshnetError] | None = None,
    retry: RetryPolicy | None = None,
    on_retry: Callable[[int, MeshnetError], None] | None = None,
    on_send: Callable[[WireHeaders], None] | None = None,
    last_only: bool = False,
    stage: str | None = None,
    annotate: Callable[[WireHeaders], WireHeaders] | None = None,
) -> RunResult:
    """Send ``array`` (already in its wire dtype) as one run; return the answers.

    ``output`` is every chunk's answer joined along the token axis (the
    copy runs in a worker thread when large), or with ``last_only`` the
    last chunk's answer alone (a generation needs only the logits after
    the prompt's last token; the other answers are not even decoded).

    The wire dtype is chosen by the caller for the whole array, never per
    chunk: wire-2 §3 requires one dtype per run, and ``auto-lossless`` per
    chunk could pick bfloat16 for one chunk and float32 for the next; so
    ``encoder`` must keep the dtype. It picks each chunk's encoding (and
    under ``auto`` learns from the link).

    Raises the failure of the lowest-indexed chunk that failed
    (``MeshnetError``: the downstream's relayed error, or 502/504 naming the
    hop), or one raised while a chunk was prepared; chunks still in flight
    are cancelled first. ``relay(response, url)`` turns a downstream's error
    answer into the error raised (default: ``response.to_error(hop=url)``,
    wire-2 §4's relay rule).

    ``retry``: a chunk whose failure ``retry.retryable`` accepts is sent
    again, identical, after ``retry.delay``, up to ``retry.retries`` times
    and never past the deadline; ``on_retry(index, error)`` is told of each.
    ``on_send(headers)`` is told of each chunk just before it goes;
    ``annotate(headers)`` may add to each chunk's headers first.
    ``stage``: the ``X-Meshnet-Stage`` every chunk carries (``"<model>/0"``,
    the stage the entry must be), or none.
    ``session_key`` goes with every chunk (wire-2 §3.9: the nodes bind the
    session to it at its first chunk).
    """
    if inflight < 1:
        raise ValueError(f"inflight must be >= 1, got {inflight}")
    chunks = plan_chunks(array, chunk_tokens)
    run = _Run(
        pool,
        encoder.codecs,
        len(chunks),
        deadline,
        inflight,
        last_only=last_only,
        relay=relay,
        retry=retry,
        on_retry=on_retry,
    )
    prepare = _preparer(encoder, request_encoding, session, base_position, stage, session_key)
    async with anyio.create_task_group() as tg:
        await run.send_all(tg, chunks, prepare, annotate, on_send)
    return await run.result()


class _Planned(Protocol):
    """A chunk of ``plan_chunks``: what its headers need of it."""

    @property
    def view(self) -> np.ndarray: ...
    @property
    def index(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def position(self) -> int: ...


def _chunk_headers(
    chunk: _Planned,
    dtype: str,
    encoding: str,
    session: str,
    base_position: int,
    *,
    stage: str | None,
    session_key: str | None,
) -> WireHeaders:
    """What one chunk of the run goes down with (the deadline is set when written)."""
    return WireHeaders(
        shape=tuple(chunk.view.shape),
        dtype=dtype,
        session=session,
        chunk_index=chunk.index,
        chunk_total=chunk.total,
        encoding=encoding,
        position=base_position + chunk.position,
        stage=stage,
        session_key=session_key,
    )


def _preparer(
    encoder: WireEncoder,
    request_encoding: str,
    session: str,
    base_position: int,
    stage: str | None,
    session_key: str | None,
) -> Callable[[_Planned], Awaitable[tuple[WireHeaders, bytes | memoryview]]]:
    """Each chunk of the run encoded, and the headers it goes down with."""

    async def prepare(chunk: _Planned) -> tuple[WireHeaders, bytes | memoryview]:
        dtype, encoding, body = await encoder.encode(chunk.view, request_encoding)
        headers = _chunk_headers(
            chunk, dtype, encoding, session, base_position, stage=stage, session_key=session_key
        )
        return headers, body

    return prepare


class _Run:
    """One run's chunks in flight: their slots, answers and failures."""

    def __init__(
        self,
        pool: Downstream,
        codecs: CodecPool,
        count: int,
        deadline: Deadline,
        inflight: int,
        *,
        last_only: bool,
        relay: Callable[[ErrorResponse, str], MeshnetError] | None,
        retry: RetryPolicy | None,
        on_retry: Callable[[int, MeshnetError], None] | None,
    ) -> None:
        self.pool, self.codecs, self.count, self.deadline = pool, codecs, count, deadline
        self.last_only, self.relay, self.retry, self.on_retry = last_only, relay, retry, on_retry
        self.last = count - 1
        self.assembler = ChunkAssembler(1 if last_only else count)
        self.results: dict[int, ChunkResult] = {}
        self.failures: dict[int, MeshnetError] = {}
        self.slots = anyio.Semaphore(inflight)
        self.joined = 0  # bytes of the answers kept: what the join copies

    def as_error(self, response: ErrorResponse) -> MeshnetError:
        url = self.pool.url
        return response.to_error(hop=url) if self.relay is None else self.relay(response, url)

    def fail(self, tg: anyio.abc.TaskGroup, index: int, error: MeshnetError) -> None:
        """The chunk failed for good: the run ends, its other chunks are cancelled."""
        self.failures[index] = error
        tg.cancel_scope.cancel()

    async def send(
        self,
        tg: anyio.abc.TaskGroup,
        index: int,
        headers: WireHeaders,
        body: bytes | memoryview,
        encode_s: float,
    ) -> None:
        started = time.perf_counter()
        try:
            response = await send_with_retries(
                self.pool,
                headers,
                body,
                self.deadline,
                self.retry,
                as_error=self.as_error,
                on_retry=self.on_retry,
            )
            check_response(self.pool, headers, response.headers)
            if not self.last_only or index == self.last:
                tensor = await self.codecs.decode(response.headers, response.body)
                self.assembler.add(0 if self.last_only else index, tensor)
                self.joined += tensor.nbytes
            self.results[index] = ChunkResult(
                request=headers,
                response=response.headers,
                raw_bytes=headers.nbytes,
                sent_bytes=memoryview(body).nbytes,
                received_bytes=len(response.body),
                seconds=encode_s + time.perf_counter() - started,
            )
        except MeshnetError as exc:
            self.fail(tg, index, exc)
        finally:
            self.slots.release()

    async def send_all(
        self,
        tg: anyio.abc.TaskGroup,
        chunks: Sequence[_Planned],
        prepare: Callable[[_Planned], Awaitable[tuple[WireHeaders, bytes | memoryview]]],
        annotate: Callable[[WireHeaders], WireHeaders] | None,
        on_send: Callable[[WireHeaders], None] | None,
    ) -> None:
        """Start each chunk's ``send`` once it is prepared and a slot is free."""
        for chunk in chunks:
            # An error here (not in a chunk's task) would leave the task
            # group as an ExceptionGroup, which no ``except MeshnetError``
            # catches: recorded like a chunk's failure instead.
            try:
                started = time.perf_counter()
                # Encode before taking a slot: chunk k+1 is compressed while
                # chunk k is still downstream, even with inflight 1.
                headers, body = await prepare(chunk)
                if annotate is not None:  # e.g. the prefix cache's keys (wire-2 §3.10)
                    headers = annotate(headers)
                encode_s = time.perf_counter() - started
                await self.slots.acquire()
            except MeshnetError as exc:
                self.fail(tg, chunk.index, exc)
                break
            if on_send is not None:
                on_send(headers)
            tg.start_soon(self.send, tg, chunk.index, headers, body, encode_s)

    async def result(self) -> RunResult:
        """The run's answers, or the failure of its lowest-indexed failed chunk."""
        if self.failures:
            raise self.failures[min(self.failures)]
        # The join copies every answer (up to max_tensor_bytes): off the loop when large.
        output = await self.codecs.run(self.joined, self.assembler.result)
        return RunResult(output=output, chunks=[self.results[i] for i in range(self.count)])

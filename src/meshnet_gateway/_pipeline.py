"""Pushing one run of chunks through a chain, up to N in flight, in order.

Shared by the gateway (``app.py``) and the client API's ``forward_via_chain``:
both cut a sequence with ``plan_chunks``, send chunk k with session, index,
total and position = base + offset, and join the last node's answers with
``ChunkAssembler``. What is valid on the wire is decided by ``meshnet_proto``;
this module only owns the concurrency: encode the next chunk while earlier
ones are downstream, keep at most ``inflight`` chunks on the wire, and turn
the first failure into one error after cancelling the rest — after
retrying a chunk whose failure ``RetryPolicy`` calls safe to retry (SPEC §3
replay makes the identical retransmission harmless).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np

from meshnet_proto import (
    ChunkAssembler,
    DownstreamError,
    ErrorResponse,
    MeshnetError,
    WireHeaders,
    plan_chunks,
)
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from meshnet_runtime.link import LinkAwareAuto

from ._retry import RetryPolicy, send_with_retries

__all__ = ["ChunkResult", "RunResult", "run_chunks"]

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


def _mismatch(pool: DownstreamPool, index: int, what: str) -> DownstreamError:
    return DownstreamError(
        f"{pool.url}: answer to chunk {index} {what}",
        code="downstream_bad_response",
        hop=pool.url,
    )


def _check_response(pool: DownstreamPool, sent: WireHeaders, got: WireHeaders) -> None:
    """The answer must describe the chunk we sent; a relay mixing up answers
    would otherwise corrupt the output silently."""
    index = sent.chunk_index
    assert index is not None
    for name in ("session", "chunk_index", "chunk_total", "position"):
        mine, theirs = getattr(sent, name), getattr(got, name)
        if theirs is not None and theirs != mine:
            raise _mismatch(pool, index, f"says {name.replace('_', '-')} {theirs}, not {mine}")


async def run_chunks(
    pool: DownstreamPool,
    codecs: CodecPool,
    array: np.ndarray,
    *,
    session: str,
    base_position: int,
    chunk_tokens: int,
    inflight: int,
    encoding_policy: str,
    request_encoding: str,
    level: int,
    deadline: Deadline,
    relay: Callable[[ErrorResponse, str], MeshnetError] | None = None,
    retry: RetryPolicy | None = None,
    on_retry: Callable[[int, MeshnetError], None] | None = None,
    auto: LinkAwareAuto | None = None,
) -> RunResult:
    """Send ``array`` (already in its wire dtype) as one run; return the joined output.

    The wire dtype is chosen by the caller for the whole array, never per
    chunk: SPEC §3 requires one dtype per run, and ``auto-lossless`` per
    chunk could pick bfloat16 for one chunk and float32 for the next.

    Raises the failure of the lowest-indexed chunk that failed
    (``MeshnetError``: the downstream's relayed error, or 502/504 naming the
    hop); chunks still in flight are cancelled first. ``relay(response, url)``
    turns a downstream's error answer into the error raised (default:
    ``response.to_error(hop=url)``, SPEC §4's relay rule).

    ``retry``: a chunk whose failure ``retry.retryable`` accepts is sent
    again, identical, after ``retry.delay``, up to ``retry.retries`` times
    and never past the deadline; ``on_retry(index, error)`` is told of each.

    ``auto``: with ``encoding_policy`` ``auto``, the link-aware choice
    (``meshnet_runtime.link``) decides each chunk's encoding and learns from it.
    """
    if inflight < 1:
        raise ValueError(f"inflight must be >= 1, got {inflight}")
    chunks = plan_chunks(array, chunk_tokens)
    assembler = ChunkAssembler(len(chunks))
    results: dict[int, ChunkResult] = {}
    failures: dict[int, MeshnetError] = {}
    slots = anyio.Semaphore(inflight)

    async def send(index: int, headers: WireHeaders, body: object, encode_s: float) -> None:
        started = time.perf_counter()
        try:
            response = await send_with_retries(
                pool, headers, body, deadline, retry, as_error=as_error, on_retry=on_retry
            )
            _check_response(pool, headers, response.headers)
            tensor = await codecs.decode(response.headers, response.body)
            assembler.add(index, tensor)
            results[index] = ChunkResult(
                request=headers,
                response=response.headers,
                raw_bytes=headers.nbytes,
                sent_bytes=len(body),  # type: ignore[arg-type]
                received_bytes=len(response.body),
                seconds=encode_s + time.perf_counter() - started,
            )
        except MeshnetError as exc:
            failures[index] = exc
            tg.cancel_scope.cancel()
        finally:
            slots.release()

    def as_error(response: ErrorResponse) -> MeshnetError:
        return response.to_error(hop=pool.url) if relay is None else relay(response, pool.url)

    async with anyio.create_task_group() as tg:
        for chunk in chunks:
            started = time.perf_counter()
            # Encode before taking a slot: chunk k+1 is compressed while
            # chunk k is still downstream, even with inflight 1.
            linked = auto is not None and encoding_policy == "auto"
            policy = auto.policy(chunk.view.nbytes) if linked else encoding_policy  # type: ignore[union-attr]
            work_s: list[float] = []
            dtype, encoding, body = await codecs.encode(
                chunk.view,
                dtype_policy="keep",
                encoding_policy=policy,
                request_encoding=request_encoding,
                level=level,
                timed=work_s.append if linked else None,
            )
            headers = WireHeaders(
                shape=tuple(chunk.view.shape),
                dtype=dtype,
                session=session,
                chunk_index=chunk.index,
                chunk_total=chunk.total,
                encoding=encoding,
                position=base_position + chunk.position,
            )
            encode_s = time.perf_counter() - started
            if linked:
                wire = memoryview(body).nbytes
                auto.observe_encoding(policy, chunk.view.nbytes, wire, encoding, sum(work_s))  # type: ignore[union-attr]
            await slots.acquire()
            tg.start_soon(send, chunk.index, headers, body, encode_s)
    if failures:
        raise failures[min(failures)]
    return RunResult(output=assembler.result(), chunks=[results[i] for i in range(len(chunks))])

"""The Python client API: forward an array through a gateway or a chain of nodes.

Async (anyio: runs on trio and on asyncio)::

    result = await forward_via_gateway("http://127.0.0.1:8000", array)
    result.output, result.session, result.position, result.headers

    result = await forward_via_chain("http://127.0.0.1:8001", array, chunk_tokens=128)
    result.chunk_headers   # every chunk response's headers, in index order

A ``Client`` keeps one pooled keep-alive connection set for many calls; the
module-level functions open one for a single call. Errors are raised as
``MeshnetError`` subclasses carrying ``status``, ``code``, ``header`` and
``hop``: ``RemoteError`` when the server answered an error, the runtime's
``DownstreamError`` (502/504, ``hop`` = the URL) when it could not be
reached or answered garbage.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from meshnet_proto import ErrorResponse, Limits, MeshnetError, WireHeaders
from meshnet_proto.lowlevel import apply_wire_dtype
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool, key_headers
from meshnet_runtime.transports import client_ssl_context
from meshnet_runtime.wire_encoder import WireEncoder

from ._pipeline import ChunkResult, run_chunks

__all__ = [
    "ChunkResult",
    "Client",
    "ForwardResult",
    "RemoteError",
    "delete_session",
    "forward_via_chain",
    "forward_via_gateway",
]


class RemoteError(MeshnetError):
    """The gateway or node answered with a wire-2 §4 error (``status`` ≥ 400).

    ``hop`` is what the server said: ``None`` when the server itself
    refused, else the URL of the deepest node that failed.
    """

    @classmethod
    def from_response(cls, response: ErrorResponse, url: str | None = None) -> RemoteError:
        """``url``: the server asked, named as ``hop`` when its answer names none
        and it is not the one we talk to directly (wire-2 §4's relay rule)."""
        inner = response.error
        header, hop = inner.get("header"), inner.get("hop")
        return cls(
            str(inner.get("message", "")),
            code=str(inner.get("code", "downstream_bad_response")),
            status=response.status,
            header=header if isinstance(header, str) else None,
            hop=hop if isinstance(hop, str) else url,
            retry_after=response.retry_after,
        )

    def __str__(self) -> str:
        where = f" at {self.hop}" if self.hop else ""
        return f"{self.status} {self.code}{where}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardResult:
    """The output of one forward and what the wire said about it.

    ``headers`` describes ``output`` (for a chain: the first chunk's response
    with the whole output's shape and ``position`` of its first token);
    ``chunk_headers`` are the responses as received, one per chunk (one for
    a gateway, which answers the whole sequence at once). ``chunks`` adds
    bytes and time per chunk.
    """

    output: np.ndarray
    session: str
    position: int
    headers: WireHeaders
    # The session's key (wire-2 §3.9): what later requests on it must carry.
    key: str | None = None
    chunk_headers: list[WireHeaders]
    chunks: list[ChunkResult] = field(default_factory=list)
    seconds: float = 0.0


class Client:
    """A pooled client of one gateway or entry node.

    ``async with Client(url) as client:`` then ``await client.forward(...)``
    (gateway) or ``await client.forward_chunks(...)`` (chain).

    ``keys`` holds the session key of every session this client started or
    was told (wire-2 §3.9); requests and DELETEs on a session carry its key.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        limits: Limits | None = None,
        max_connections: int = 16,
    ) -> None:
        self.limits = limits or Limits()
        ssl_context = client_ssl_context(tls_ca) if url.startswith("https:") else None
        # margin=0: we are the origin; the server subtracts its own margins.
        self.pool = DownstreamPool(
            url,
            limits=self.limits,
            token=token,
            ssl_context=ssl_context,
            max_connections=max_connections,
            margin=0.0,
        )
        self.codecs = CodecPool(limits=self.limits)
        self.keys: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self.pool.url

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.pool.aclose()

    # ------------------------------------------------------------ gateway

    async def forward(
        self,
        array: np.ndarray,
        *,
        session: str | None = None,
        position: int | None = None,
        encoding: str = "zstd",
        wire_dtype: str = "keep",
        level: int = 1,
        timeout: float = 60.0,
        key: str | None = None,
    ) -> ForwardResult:
        """POST ``array`` as one whole sequence to a gateway (``session`` None: a new one).

        ``key``: the session's key (default: the one this client keeps for
        it); a key the gateway mints for a new session is kept.
        """
        if key is None and session is not None:
            key = self.keys.get(session)
        started = time.perf_counter()
        deadline = Deadline.after(timeout)
        wire = await self.codecs.run(array.nbytes, apply_wire_dtype, array, wire_dtype)
        dtype, chosen, body = await self.codecs.encode(
            wire, encoding_policy=encoding, request_encoding="identity", level=level
        )
        headers = WireHeaders(
            shape=tuple(wire.shape),
            dtype=dtype,
            session=session,
            encoding=chosen,
            position=position,
            session_key=key,
        )
        response = await self.pool.forward(headers, body, deadline)
        if isinstance(response, ErrorResponse):
            raise RemoteError.from_response(response)
        output = await self.codecs.decode(response.headers, response.body)
        got = response.headers
        if got.session is not None and (got.session_key or key) is not None:
            key = self.keys[got.session] = got.session_key or key  # type: ignore[assignment]
        seconds = time.perf_counter() - started
        stat = ChunkResult(
            request=headers,
            response=got,
            raw_bytes=headers.nbytes,
            sent_bytes=len(body),
            received_bytes=len(response.body),
            seconds=seconds,
        )
        return ForwardResult(
            output=output,
            session=got.session or session or "",
            position=got.position if got.position is not None else (position or 0),
            headers=got,
            chunk_headers=[got],
            chunks=[stat],
            seconds=seconds,
            key=key,
        )

    # ------------------------------------------------------------ chain

    async def forward_chunks(
        self,
        array: np.ndarray,
        *,
        session: str | None = None,
        position: int = 0,
        chunk_tokens: int = 128,
        inflight: int = 1,
        encoding: str = "zstd",
        wire_dtype: str = "keep",
        level: int = 1,
        timeout: float = 60.0,
        key: str | None = None,
    ) -> ForwardResult:
        """Send ``array`` straight to an entry node, chunked here, as one run.

        ``position`` is the session's position (0 for a new session; the sum
        of the tokens sent so far to continue one). Keep ``inflight`` at or
        under the entry node's reorder window. ``key``: the session's key
        (default: the one kept for it, or a new one for a session this starts).
        """
        started = time.perf_counter()
        deadline = Deadline.after(timeout)
        session = session or str(uuid.uuid4())
        if key is None:
            key = self.keys.get(session) or secrets.token_hex(16)
        self.keys[session] = key
        # One wire dtype for the whole run (wire-2 §3).
        wire = await self.codecs.run(array.nbytes, apply_wire_dtype, array, wire_dtype)
        result = await run_chunks(
            self.pool,
            WireEncoder(self.codecs, encoding=encoding, level=level),
            wire,
            session=session,
            session_key=key,
            base_position=position,
            chunk_tokens=chunk_tokens,
            inflight=inflight,
            deadline=deadline,
            relay=RemoteError.from_response,
        )
        chunk_headers = [chunk.response for chunk in result.chunks]
        first = chunk_headers[0]
        headers = first.replace(
            shape=tuple(result.output.shape), chunk_index=None, chunk_total=None
        )
        return ForwardResult(
            output=result.output,
            session=session,
            position=position,
            headers=headers,
            chunk_headers=chunk_headers,
            chunks=result.chunks,
            seconds=time.perf_counter() - started,
            key=key,
        )

    # ------------------------------------------------------------ control

    async def delete_session(
        self, session: str, *, timeout: float = 10.0, key: str | None = None
    ) -> bool:
        """``DELETE /sessions/{id}``: True if ended (204), False if unknown (404).

        Carries ``key`` (default: the one kept for the session)."""
        response = await self.pool.request(
            "DELETE",
            f"/sessions/{session}",
            Deadline.after(timeout),
            key_headers(key or self.keys.get(session)),
        )
        if isinstance(response, ErrorResponse):
            if response.status == 404:
                return False
            raise RemoteError.from_response(response)
        return True

    async def info(self, *, timeout: float = 10.0) -> dict[str, Any]:
        response = await self.pool.request("GET", "/info", Deadline.after(timeout))
        if isinstance(response, ErrorResponse):
            raise RemoteError.from_response(response)
        document = json.loads(response.body)
        if not isinstance(document, dict):
            raise ValueError(f"{self.url}/info is not a JSON object")
        return document


async def forward_via_gateway(
    url: str,
    array: np.ndarray,
    *,
    session: str | None = None,
    position: int | None = None,
    encoding: str = "zstd",
    wire_dtype: str = "keep",
    token: str | None = None,
    timeout: float = 60.0,
    tls_ca: str | None = None,
    key: str | None = None,
) -> ForwardResult:
    """One request through a gateway (see ``Client.forward``)."""
    async with Client(url, token=token, tls_ca=tls_ca) as client:
        return await client.forward(
            array,
            session=session,
            position=position,
            encoding=encoding,
            wire_dtype=wire_dtype,
            timeout=timeout,
            key=key,
        )


async def forward_via_chain(
    entry_url: str,
    array: np.ndarray,
    *,
    session: str | None = None,
    position: int = 0,
    chunk_tokens: int = 128,
    inflight: int = 1,
    encoding: str = "zstd",
    wire_dtype: str = "keep",
    token: str | None = None,
    timeout: float = 60.0,
    tls_ca: str | None = None,
    key: str | None = None,
) -> ForwardResult:
    """One run straight through a chain of nodes (see ``Client.forward_chunks``)."""
    async with Client(entry_url, token=token, tls_ca=tls_ca) as client:
        return await client.forward_chunks(
            array,
            session=session,
            position=position,
            chunk_tokens=chunk_tokens,
            inflight=inflight,
            encoding=encoding,
            wire_dtype=wire_dtype,
            timeout=timeout,
            key=key,
        )


async def delete_session(
    url: str,
    session: str,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    key: str | None = None,
) -> bool:
    """End ``session`` (with its ``key``) at a gateway or node and down its chain."""
    async with Client(url, token=token) as client:
        return await client.delete_session(session, timeout=timeout, key=key)

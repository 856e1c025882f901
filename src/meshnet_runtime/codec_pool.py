"""Tensor codec work off the event loop.

zstd (de)compression of a 32 MiB chunk takes tens of milliseconds: done on
the event loop it would stall every other session. Large work goes to a
worker thread via ``anyio.to_thread.run_sync`` under a ``CapacityLimiter``;
each worker thread keeps its own zstd compressor and decompressor
(``threading.local``) because those objects are not thread-safe and are
expensive to build. Threads are allowed here, never in ``meshnet_proto``.

Small tensors are handled inline: a thread hop is not free. Measured on the
project's 2-core CI box (numpy float32 with some redundancy, zstd level 1,
docs/runtime.md has the table): a hop costs ~0.25-0.35 ms on either backend;
decoding 128 KiB takes ~0.5-0.65 ms, 256 KiB ~0.8-1.4 ms, 1 MiB ~4-5 ms;
encoding about 2.5x that. At ``INLINE_BYTES`` = 256 KiB the worst inline stall
is about a millisecond (a few hops' worth), and everything larger, where the
stall grows linearly, leaves the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import numpy as np
import zstandard

from meshnet_proto import (
    EncodingPolicy,
    Limits,
    WireDtypePolicy,
    WireHeaders,
    encode_for_wire,
    encode_tensor,
)
from meshnet_proto.lowlevel import decode_tensor, wire_dtype_name

from .metrics import ServerMetrics

__all__ = ["INLINE_BYTES", "CodecPool"]

T = TypeVar("T")

# Below this many bytes (decoded tensor size) work runs on the event loop.
INLINE_BYTES = 256 * 1024


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        found = self.compressors.get(level)
        if found is None:
            found = self.compressors[level] = zstandard.ZstdCompressor(
                level=level, write_content_size=True
            )
        return found


class CodecPool:
    """Encode and decode wire tensors, inline when small, in threads when large."""

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        threads: int = 4,
        inline_bytes: int = INLINE_BYTES,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.limiter = anyio.CapacityLimiter(threads)
        self.inline_bytes = inline_bytes
        self.metrics = metrics
        self._local = _PerThread()

    async def run(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` inline when ``nbytes`` is small, else in a worker thread."""
        if nbytes < self.inline_bytes:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def decode(
        self, headers: WireHeaders, body: bytes | bytearray | memoryview
    ) -> np.ndarray:
        """``decode_tensor`` with this thread's decompressor (read-only result)."""

        def work() -> np.ndarray:
            start = time.perf_counter()
            try:
                return decode_tensor(
                    headers, body, limits=self.limits, decompressor=self._local.decompressor
                )
            finally:
                self._observe("decode", start)

        # Identity decoding is a zero-copy view: never worth a thread.
        size = headers.nbytes if headers.encoding == "zstd" else 0
        return await self.run(size, work)

    @staticmethod
    def encode_trivially(
        array: np.ndarray,
        dtype_policy: WireDtypePolicy | str,
        encoding_policy: EncodingPolicy | str,
        request_encoding: str,
    ) -> tuple[str, str, bytes | memoryview] | None:
        """``encode``'s answer when it is trivial, else None: the body a view
        of the array, no conversion, no compression (a decode step's usual
        answer), done at once, untimed, without a coroutine or the
        worker-thread machinery (section decode). Not for a strided array (a
        chunk of a batch > 1): making it contiguous is a full copy."""
        if (
            array.flags.c_contiguous
            and dtype_policy == WireDtypePolicy.KEEP
            and (
                encoding_policy == EncodingPolicy.IDENTITY
                or (encoding_policy == EncodingPolicy.MIRROR and request_encoding == "identity")
            )
        ):
            # encode_for_wire's answer for these policies, its steps skipped:
            # encode_tensor refuses any dtype that is not a wire dtype (in
            # either byte order). wire_dtype_name, not numpy's dtype.name
            # (~0.7 us a call): the same token, by a dict lookup.
            body = encode_tensor(array)
            return wire_dtype_name(array.dtype), "identity", body
        return None

    async def encode(
        self,
        array: np.ndarray,
        *,
        dtype_policy: WireDtypePolicy | str = WireDtypePolicy.KEEP,
        encoding_policy: EncodingPolicy | str = EncodingPolicy.MIRROR,
        request_encoding: str = "identity",
        level: int = 1,
        timed: Callable[[float], None] | None = None,
    ) -> tuple[str, str, bytes | memoryview]:
        """``encode_for_wire``: (wire dtype, encoding, body), off-loop when large.

        ``timed(seconds)`` is told the CPU time the encoding itself took (not
        the wait for a worker thread, the event loop or the GIL, which under
        load dwarf it): what a sender weighing compression against its link
        needs (``meshnet_runtime.link``).
        """

        trivial = self.encode_trivially(array, dtype_policy, encoding_policy, request_encoding)
        if trivial is not None:
            return trivial

        def work() -> tuple[str, str, bytes | memoryview]:
            start = time.perf_counter()
            cpu_start = time.thread_time()
            try:
                return encode_for_wire(
                    array,
                    dtype_policy=WireDtypePolicy(dtype_policy),
                    encoding_policy=EncodingPolicy(encoding_policy),
                    request_encoding=request_encoding,
                    level=level,
                    compressor=self._local.compressor(level),
                )
            finally:
                self._observe("encode", start)
                if timed is not None:
                    timed(time.thread_time() - cpu_start)

        return await self.run(array.nbytes, work)

    def _observe(self, op: str, start: float) -> None:
        if self.metrics:
            self.metrics.labelled(self.metrics.codec_seconds, op).observe(
                time.perf_counter() - start
            )

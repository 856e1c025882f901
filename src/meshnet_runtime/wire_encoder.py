"""Encoding the tensors sent one way, under one policy: "encode, then learn".

A node encodes its answers toward ``--next``, the gateway its chunks toward
the entry node and its answers toward clients. Each direction has one
``WireEncoder``: it holds the ``--wire-dtype``/``--encoding``/``--zstd-level``
settings and, under ``--encoding auto`` with a measured link, the
link-aware choice (``meshnet_runtime.link``), which picks each body's
encoding and then learns from what that encode cost and saved.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .codec_pool import CodecPool
from .link import LinkAwareAuto, LinkEstimate

__all__ = ["WireEncoder"]


class WireEncoder:
    """``encode(array, request_encoding)`` -> (wire dtype, encoding, body)."""

    def __init__(
        self,
        codecs: CodecPool,
        *,
        dtype_policy: str = "keep",
        encoding: str = "mirror",
        level: int = 1,
        link: LinkEstimate | None = None,
    ) -> None:
        self.codecs = codecs
        self.dtype_policy = dtype_policy
        self.encoding = encoding
        self.level = level
        # Only ``auto`` weighs the link; a fixed policy needs no estimate.
        self.auto = LinkAwareAuto(link) if encoding == "auto" and link is not None else None

    def encode_now(
        self, array: np.ndarray, request_encoding: str = "identity"
    ) -> tuple[str, str, bytes | memoryview] | None:
        """``encode``'s answer when it needs no work (``CodecPool.encode_trivially``),
        else None: the caller then awaits ``encode``."""
        if self.auto is not None:
            return None  # auto weighs every encoding it makes
        return self.codecs.encode_trivially(
            array, self.dtype_policy, self.encoding, request_encoding
        )

    async def encode(
        self, array: np.ndarray, request_encoding: str = "identity"
    ) -> tuple[str, str, bytes | memoryview]:
        auto = self.auto
        policy = self.encoding if auto is None else auto.policy(array.nbytes)
        work_s: list[float] = []
        dtype, encoding, body = await self.codecs.encode(
            array,
            dtype_policy=self.dtype_policy,
            encoding_policy=policy,
            request_encoding=request_encoding,
            level=self.level,
            timed=None if auto is None else work_s.append,
        )
        if auto is not None:
            wire = memoryview(body).nbytes
            auto.observe_encoding(policy, array.nbytes, wire, encoding, sum(work_s))
        return dtype, encoding, body

    def describe(self) -> dict[str, Any] | None:
        """The link-aware choice's state for ``/info`` (None without one)."""
        return None if self.auto is None else self.auto.describe()

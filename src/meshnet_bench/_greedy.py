"""One greedy generation through the gateway's own generation code
(``ChainSession``), timed as the sections that measure TTFT and per-token
latency need it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from meshnet_gateway.openai.generation import ChainSession, ChainSettings
from meshnet_gateway.tenancy import Tenancy
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import Downstream

__all__ = ["Greedy", "greedy"]


@dataclass(frozen=True, slots=True)
class Greedy:
    ttft: float  # seconds: the prefill (the first token is sampled from its logits)
    first_logits: np.ndarray
    tokens: list[int]


async def greedy(
    pool: Downstream,
    codecs: CodecPool,
    settings: ChainSettings,
    ids: Sequence[int],
    answer: int,
    timed: Callable[[float], None] | None = None,
    tenancy: Tenancy | None = None,
) -> Greedy:
    """``answer`` greedy tokens after ``ids``; ``timed`` gets each decode step's
    wall time; ``tenancy``: whom the session serves (wire-2 §3.15). The
    session is closed at the chain whatever happens."""
    chain = ChainSession(pool, codecs, settings, tenancy=tenancy)
    try:
        started = time.perf_counter()
        first = logits = await chain.prefill(ids)
        ttft = time.perf_counter() - started
        tokens = [int(np.argmax(logits))]
        for _ in range(answer - 1):
            started = time.perf_counter()
            logits = await chain.step(tokens[-1])
            if timed is not None:
                timed(time.perf_counter() - started)
            tokens.append(int(np.argmax(logits)))
        return Greedy(ttft, first, tokens)
    finally:
        await chain.close()

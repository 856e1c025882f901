"""Memory: what relaying one large activation costs a node, in RSS.

Two real ``meshnet-node`` processes: a relay (``--next``) and a last node
(echo). A 256 MiB bfloat16 activation (identity) goes through the relay and
back; the figure is the relay's peak RSS increase (``VmHWM`` after, minus
``VmRSS`` before, with the peak reset first where Linux allows it) divided
by the payload size. The floor for a relay that holds the request while
the answer comes back is about 2: the request body it forwards and the
answer it relays.

Key: ``relay_rss_over_payload``.
"""

from __future__ import annotations

import uuid

import anyio
import numpy as np

from meshnet_bench.activations import make_activation
from meshnet_proto import ActivationResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool

from ._result import BenchOptions, SectionResult
from ._support import (
    QUIET,
    MiB,
    current_rss_bytes,
    mib,
    peak_rss_bytes,
    reset_peak_rss,
    server_process,
)

KEYS = ("relay_rss_over_payload",)

HIDDEN = 4096


def _activation(nbytes: int) -> np.ndarray:
    """``nbytes`` of realistic bfloat16, tiled from a 4 MiB draw (fast to make)."""
    tile = make_activation(min(nbytes, 4 * MiB) // (HIDDEN * 2), HIDDEN)
    return np.tile(tile, (1, nbytes // tile.nbytes, 1))


async def _forward(url: str, array: np.ndarray) -> None:
    pool = DownstreamPool(url, max_connections=1)
    try:
        headers = WireHeaders(
            shape=array.shape,
            dtype="bfloat16",
            session=str(uuid.uuid4()),
            chunk_index=0,
            chunk_total=1,
            encoding="identity",
            position=0,
        )
        body = array.reshape(-1).view(np.uint8).data
        response = await pool.forward(headers, body, Deadline.after(120.0))
        if not isinstance(response, ActivationResponse) or len(response.body) != array.nbytes:
            raise RuntimeError(f"the relay did not answer the activation: {response!r}")
    finally:
        await pool.aclose()


def run(options: BenchOptions) -> SectionResult:
    nbytes = 4 * MiB if options.tiny else 256 * MiB
    options.progress(f"memory: a relay node's peak RSS increase relaying {mib(nbytes)}")
    array = _activation(nbytes)
    backend = ["--async-backend", options.async_backend]
    with (
        server_process("meshnet_node", *QUIET, *backend) as (_, last_url),
        server_process("meshnet_node", *QUIET, *backend, "--next", last_url) as (relay, relay_url),
    ):
        # Warm-up: imports done, connections open, the codec pool started.
        anyio.run(_forward, relay_url, array[:, :1], backend=options.async_backend)
        exact = reset_peak_rss(relay.pid)
        before = current_rss_bytes(relay.pid) if exact else peak_rss_bytes(relay.pid)
        anyio.run(_forward, relay_url, array, backend=options.async_backend)
        peak = peak_rss_bytes(relay.pid)
    increase = peak - before
    result = SectionResult(
        title=f"memory: relay node relaying {mib(nbytes)} bfloat16 identity (real processes)",
        keys={"relay_rss_over_payload": round(increase / nbytes, 3)},
    )
    result.rows.append(
        {
            "RSS before": mib(before),
            "peak RSS": mib(peak),
            "increase": mib(increase),
            "increase / payload": f"{increase / nbytes:.2f}",
        }
    )
    if not exact:
        result.notes.append("peak RSS could not be reset: the figure includes the warm-up")
    return result

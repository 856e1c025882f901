"""Pipelining: chunks through a two-node chain with simulated stage time.

A gateway cuts a ``[1, 8 x 16, 4096]`` bfloat16 sequence into 8 chunks and
sends them through 2 nodes that each sleep ``--delay-ms 50`` per chunk. A
perfect pipeline takes ``(chunks + stages - 1) x delay``; ``--inflight 1``
takes about ``chunks x stages x delay``. Both windows run in this process on
the same data (best of the repeats: the ideal is a floor, and a neighbour's
load only ever adds), and the outputs must be bit-identical.

Key: ``pipeline_efficiency`` (ideal ÷ measured, ``--inflight 4``).
"""

from __future__ import annotations

import contextlib

import anyio
import numpy as np

from meshnet_bench.activations import make_activation
from meshnet_gateway import Client, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig

from ._result import BenchOptions, SectionResult
from ._support import QUIET, best_forward, ms, ratio

KEYS = ("pipeline_efficiency",)

CHUNKS = 8
STAGES = 2
CHUNK_TOKENS = 16
HIDDEN = 4096
WINDOWS = (1, 4)


async def measure(delay_ms: int, window: int, repeat: int) -> tuple[float, np.ndarray]:
    """Best wall time of ``repeat`` forwards through a fresh chain, and the output."""
    array = make_activation(CHUNKS * CHUNK_TOKENS, HIDDEN)
    async with contextlib.AsyncExitStack() as stack:
        next_flags: list[str] = []
        for _ in range(STAGES):
            flags = [*QUIET, "--delay-ms", str(delay_ms), *next_flags]
            node = await stack.enter_async_context(serve_node(NodeConfig.load(flags)))
            next_flags = ["--next", node.url]
        gateway_flags = [
            *QUIET,
            "--entry",
            node.url,
            "--chunk-tokens",
            str(CHUNK_TOKENS),
            "--inflight",
            str(window),
        ]
        gateway = await stack.enter_async_context(open_gateway(GatewayConfig.load(gateway_flags)))
        client = await stack.enter_async_context(Client(gateway.url))
        best, output = await best_forward(client, array, encoding="identity", repeat=repeat)
        if output.tobytes() != array.tobytes():
            raise RuntimeError(f"--inflight {window}: the output is not the input")
        return best, output


def run(options: BenchOptions) -> SectionResult:
    delay_ms = 5 if options.tiny else 50
    repeat = 1 if options.tiny else 2 if options.quick else 5
    ideal = (CHUNKS + STAGES - 1) * delay_ms / 1000
    options.progress(
        f"pipeline: {CHUNKS} chunks x {STAGES} nodes, --delay-ms {delay_ms}, "
        f"--inflight {' and '.join(map(str, WINDOWS))}, best of {repeat}"
    )
    measured = {
        window: anyio.run(measure, delay_ms, window, repeat, backend=options.async_backend)[0]
        for window in WINDOWS
    }
    result = SectionResult(
        title=f"pipelining: {CHUNKS} chunks through {STAGES} nodes at --delay-ms {delay_ms}, "
        f"best of {repeat}",
        keys={"pipeline_efficiency": ratio(ideal, measured[4])},
    )
    for window, seconds in measured.items():
        result.rows.append(
            {
                "--inflight": str(window),
                "measured": ms(seconds),
                "ideal pipeline": ms(ideal),
                "ideal / measured": f"{ideal / seconds:.2f}",
            }
        )
    result.notes.append(
        f"serial would be {CHUNKS * STAGES * delay_ms} ms; outputs checked bit-identical"
    )
    return result

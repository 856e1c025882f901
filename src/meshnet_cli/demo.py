"""``meshnet demo``: the US-011 story on real sockets, in one process.

Two echo nodes and a gateway on free loopback ports; a bfloat16 activation
pushed through them in chunks — once straight through the chain (the client
chunks, so every chunk's response headers can be shown) and once through
the gateway (it chunks); both outputs must equal the input bit for bit.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable

import anyio
import numpy as np

from meshnet_bench.activations import SEED, make_activation, wire1_body_size
from meshnet_gateway import ForwardResult, forward_via_chain, forward_via_gateway, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig

__all__ = ["run_demo", "table", "wire_check"]
DATA_DESCRIPTION = (
    "synthetic hidden states (seed {seed}): N(0,1) x a log-normal per-channel\n"
    "      scale (median 0.5), 4 outlier channels x 30, cast to bfloat16 (round to nearest even)"
)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bytes(np.ascontiguousarray(a).view(np.uint8)) == bytes(
        np.ascontiguousarray(b).view(np.uint8)
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(rows: list[list[str]], right: set[int], *, rule: bool = True) -> list[str]:
    """``rows`` (the first the header) as aligned text lines, the columns in
    ``right`` right-aligned; ``rule``: a line of dashes under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
        if n == 0 and rule:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def _chunk_table(result: ForwardResult, wire1: Callable[[int], int]) -> list[str]:
    rows = [
        [
            "chunk",
            "position",
            "shape",
            "dtype",
            "encoding",
            "raw bytes",
            "sent",
            "received",
            "ratio",
            "wire 1 (b64 JSON)",
            "time",
        ]
    ]
    for chunk in result.chunks:
        got = chunk.response
        rows.append(
            [
                f"{got.chunk_index}/{got.chunk_total}",
                str(got.position),
                "x".join(map(str, got.shape)),
                got.dtype,
                got.encoding,
                f"{chunk.raw_bytes:,}",
                f"{chunk.sent_bytes:,}",
                f"{chunk.received_bytes:,}",
                f"{chunk.raw_bytes / chunk.sent_bytes:.2f}x",
                f"{wire1(chunk.request.chunk_index or 0):,}",
                f"{chunk.seconds * 1000:.1f} ms",
            ]
        )
    return table(rows, right={1, 5, 6, 7, 8, 9, 10})


async def wire_check(
    tokens: int, hidden: int, chunk_tokens: int, inflight: int, out: Callable[[str], None]
) -> bool:
    """The stub activation through two echo nodes, straight and via the
    gateway, each answer told chunk by chunk; True when both are bit-exact.
    (``meshnet demo --no-model``, and the second half of ``meshnet demo``.)"""
    array = make_activation(tokens, hidden)
    raw = array.nbytes
    out(f"meshnet demo: wire 2 end to end in one process (Python {platform.python_version()})")
    out(
        f"data: activation 1x{tokens}x{hidden} bfloat16, {raw:,} bytes ({_mib(raw)}),\n      "
        + DATA_DESCRIPTION.format(seed=SEED)
    )
    node = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    gateway_flags = ["--chunk-tokens", str(chunk_tokens), "--inflight", str(inflight)]
    async with (
        serve_node(NodeConfig.load(node)) as last,
        serve_node(NodeConfig.load([*node, "--next", last.url])) as entry,
        open_gateway(GatewayConfig.load([*node, "--entry", entry.url, *gateway_flags])) as gateway,
    ):
        out(f"  node 2  {last.url}   (last stage, backend echo)")
        out(f"  node 1  {entry.url}   (backend echo, --next {last.url})")
        out(
            f"  gateway {gateway.url}   (--entry {entry.url}, --chunk-tokens "
            f"{chunk_tokens}, --inflight {gateway.app.inflight})"
        )
        out("")

        # 1. The client chunks: every chunk response's headers are visible.
        chain = await forward_via_chain(
            entry.url, array, chunk_tokens=chunk_tokens, inflight=inflight
        )
        out(
            f"client -> node 1 -> node 2, {len(chain.chunks)} chunks of {chunk_tokens} "
            f"tokens, zstd, session {chain.session}:"
        )
        views = [
            array[:, i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(len(chain.chunks))
        ]
        for line in _chunk_table(chain, lambda i: wire1_body_size(views[i])):
            out(line)
        out("")

        # 2. The gateway chunks: one request, one response.
        via = await forward_via_gateway(gateway.url, array)
        got = via.headers
        out(
            f"client -> gateway -> node 1 -> node 2, one request of {tokens} tokens "
            f"(the gateway sends {-(-tokens // chunk_tokens)} chunks):"
        )
        out(
            f"  response: shape {'x'.join(map(str, got.shape))}, {got.dtype}, {got.encoding}, "
            f"session {got.session}, position {got.position}\n"
            f"  sent {via.chunks[0].sent_bytes:,} B, received "
            f"{via.chunks[0].received_bytes:,} B in {via.seconds * 1000:.1f} ms"
        )
        out("")

    return _summary(out, array, chain, via, views)


def _summary(
    out: Callable[[str], None],
    array: np.ndarray,
    chain: ForwardResult,
    via: ForwardResult,
    views: list[np.ndarray],
) -> bool:
    """The bytes each format sends, and whether both paths gave the input back."""
    raw = array.nbytes
    wire2 = sum(chunk.sent_bytes for chunk in chain.chunks)
    wire1 = sum(wire1_body_size(v) for v in views)
    out(f"summary: the {len(chain.chunks)} chunk request bodies, client -> node 1")
    rows = [
        ["format", "bytes", "vs raw"],
        ["raw bfloat16 tensor", f"{raw:,}", "1.00x"],
        ["wire 2, identity", f"{raw:,}", "1.00x"],
        ["wire 2, zstd level 1", f"{wire2:,}", f"{wire2 / raw:.2f}x"],
        ["wire 1, base64 in JSON", f"{wire1:,}", f"{wire1 / raw:.2f}x"],
    ]
    for line in table(rows, right={1, 2}):
        out(line)
    out(
        f"  wire 2 zstd sends {wire1 / wire2:.2f}x fewer bytes than wire 1 "
        f"({(1 - wire2 / wire1) * 100:.0f}% less).\n"
        "  bfloat16 mantissas of real-valued data are near-random: zstd saves on the\n"
        "  sign/exponent byte only, so ~0.8x of raw is the honest figure for this data."
    )
    out("")
    ok = True
    for name, result in (("chain", chain), ("gateway", via)):
        if _same_bits(result.output, array):
            out(f"check: {name} output == input, bit for bit: yes")
        else:
            ok = False
            out(
                f"check: {name} output differs from the input "
                f"({result.output.dtype} {result.output.shape} vs {array.dtype} {array.shape})"
            )
    return ok


def run_demo(
    *,
    tokens: int = 512,
    hidden: int = 4096,
    chunk_tokens: int = 128,
    inflight: int = 1,
    backend: str = "trio",
) -> int:
    started = time.perf_counter()

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        ok = anyio.run(wire_check, tokens, hidden, chunk_tokens, inflight, out, backend=backend)
    except Exception as exc:  # a clear message, not a traceback, on a fresh machine
        print(f"meshnet demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("meshnet demo FAILED: the output is not the input", file=sys.stderr)
        return 1
    out(f"demo done in {time.perf_counter() - started:.2f} s on {backend}")
    return 0

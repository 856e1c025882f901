"""Wire 1 against wire 2, end to end: client → gateway → 2 echo nodes → back.

The same float32 ``[1, 2048, 4096]`` activation (realistic values: see
``make_activation``) goes through a wire-1 gateway and chain (base64 in
JSON, :mod:`meshnet_bench._wire1`) and through meshnet's own gateway and
nodes with wire 2 as float32 identity, bfloat16 identity and bfloat16 zstd.
Everything runs in this process on loopback, on one event loop, so each
format pays for every hop's CPU the same way. Repeats are interleaved and
the median kept.

Keys: ``wire1_over_wire2_time`` (wire-1 time ÷ the fastest wire-2 time),
``wire2_over_wire1_bytes`` (bfloat16 + zstd request body ÷ wire-1 body).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import numpy as np

from meshnet_bench.activations import make_activation
from meshnet_gateway import Client, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig

from . import _wire1
from ._result import BenchOptions, SectionResult
from ._support import QUIET, interleaved, median, mib, ms, rate_mb_s, ratio, times_x

KEYS = ("wire1_over_wire2_time", "wire2_over_wire1_bytes")

HIDDEN = 4096
# name -> (wire dtype, encoding) of the wire-2 request
WIRE2 = {
    "wire 2 float32 identity": ("keep", "identity"),
    "wire 2 bfloat16 identity": ("bfloat16", "identity"),
    "wire 2 bfloat16 zstd": ("bfloat16", "zstd"),
}
WIRE1 = "wire 1 float32 base64 JSON"
# A server closes a keep-alive connection that sends no head for
# --head-timeout (10 s): on a loaded machine a wire-1 turn can outlast that
# while the client's wire-2 connection waits, and a gateway input (no
# session) is not retried on a stale connection. Not what is measured here.
KEEP_IDLE = [*QUIET, "--head-timeout", "600"]


@dataclass(frozen=True, slots=True)
class Point:
    """One format at one size: median seconds and request body bytes."""

    name: str
    tensor_bytes: int  # the float32 activation's size
    seconds: float
    body_bytes: int

    @property
    def mb_s(self) -> float:
        return rate_mb_s(self.tensor_bytes, self.seconds)


@dataclass(slots=True)
class _Stacks:
    wire1: _wire1.Wire1Client
    wire2: Client


@contextlib.asynccontextmanager
async def _stacks(chunk_tokens: int, inflight: int) -> AsyncIterator[_Stacks]:
    """Both gateways and their two-node chains, on free loopback ports."""
    async with contextlib.AsyncExitStack() as stack:
        w1_last = await stack.enter_async_context(_wire1.serve_wire1())
        w1_entry = await stack.enter_async_context(_wire1.serve_wire1(w1_last.url))
        w1_gateway = await stack.enter_async_context(_wire1.serve_wire1(w1_entry.url))
        wire1 = _wire1.Wire1Client.for_url(w1_gateway.url)
        stack.push_async_callback(wire1.aclose)

        last = await stack.enter_async_context(serve_node(NodeConfig.load(KEEP_IDLE)))
        entry = await stack.enter_async_context(
            serve_node(NodeConfig.load([*KEEP_IDLE, "--next", last.url]))
        )
        flags = [
            *KEEP_IDLE,
            "--entry",
            entry.url,
            "--chunk-tokens",
            str(chunk_tokens),
            "--inflight",
            str(inflight),
        ]
        gateway = await stack.enter_async_context(open_gateway(GatewayConfig.load(flags)))
        wire2 = await stack.enter_async_context(Client(gateway.url))
        yield _Stacks(wire1, wire2)


Call = Callable[[np.ndarray], Awaitable[None]]


def _contenders(stacks: _Stacks, sizes: dict[str, int]) -> dict[str, Call]:
    """One call per format; each checks its output so a wrong answer cannot be fast."""

    async def wire1(array: np.ndarray) -> None:
        body = _wire1.encode_body(array)
        sizes[WIRE1] = len(body)
        output = _wire1.decode_body(await stacks.wire1.post(body))
        if not np.array_equal(output, array):
            raise RuntimeError("wire 1 output differs from its input")

    def wire2(dtype: str, encoding: str) -> Call:
        async def call(array: np.ndarray) -> None:
            result = await stacks.wire2.forward(array, encoding=encoding, wire_dtype=dtype)
            sizes[f"wire 2 {_label(dtype)} {encoding}"] = sum(c.sent_bytes for c in result.chunks)
            if result.output.shape != array.shape:
                raise RuntimeError("wire 2 output has the wrong shape")

        return call

    calls: dict[str, Call] = {WIRE1: wire1}
    for dtype, encoding in WIRE2.values():
        calls[f"wire 2 {_label(dtype)} {encoding}"] = wire2(dtype, encoding)
    return calls


def _label(dtype: str) -> str:
    return "float32" if dtype == "keep" else dtype


async def measure(
    tokens: int,
    repeat: int,
    *,
    chunk_tokens: int = 128,
    inflight: int = 4,
    progress: Callable[[str], None] | None = None,
) -> list[Point]:
    """Every format at ``[1, tokens, 4096]`` float32: ``repeat`` interleaved
    timed runs each, after one token each has opened every connection."""
    array = make_activation(tokens, HIDDEN, dtype=np.float32)
    sizes: dict[str, int] = {}
    async with _stacks(chunk_tokens, inflight) as stacks:
        calls = _contenders(stacks, sizes)
        for call in calls.values():
            await call(array[:, :1])
        times = await interleaved(
            {name: functools.partial(call, array) for name, call in calls.items()},
            repeat,
            progress=progress,
        )
    return [Point(name, array.nbytes, median(times[name]), sizes[name]) for name in calls]


def _tokens(options: BenchOptions) -> tuple[int, int]:
    """(tokens, repeats) for this run."""
    if options.tiny:
        return 8, 1
    return 2048, 1 if options.quick else 5


def run(options: BenchOptions) -> SectionResult:
    tokens, repeat = _tokens(options)
    options.progress(
        f"wire: wire 1 vs wire 2 end to end, [1, {tokens}, {HIDDEN}] float32, "
        f"{repeat} interleaved repeats"
    )
    points = anyio.run(
        functools.partial(measure, tokens, repeat, progress=options.progress),
        backend=options.async_backend,
    )
    by_name = {p.name: p for p in points}
    wire1 = by_name[WIRE1]
    fastest = min((p for p in points if p.name != WIRE1), key=lambda p: p.seconds)
    zstd = by_name["wire 2 bfloat16 zstd"]
    result = SectionResult(
        title=f"wire 1 vs wire 2, end to end (client -> gateway -> 2 echo nodes), "
        f"[1, {tokens}, {HIDDEN}] float32 ({mib(wire1.tensor_bytes)}), median of {repeat}",
        keys={
            "wire1_over_wire2_time": ratio(wire1.seconds, fastest.seconds),
            "wire2_over_wire1_bytes": ratio(zstd.body_bytes, wire1.body_bytes),
        },
    )
    for p in points:
        result.rows.append(
            {
                "format": p.name,
                "request body": f"{p.body_bytes:,} B",
                "bytes vs wire 1": times_x(p.body_bytes / wire1.body_bytes),
                "time": ms(p.seconds),
                "MB/s (float32)": f"{p.mb_s:.0f}",
                "wire 1 time / this": times_x(wire1.seconds / p.seconds),
            }
        )
    result.notes.append(f"fastest wire 2: {fastest.name}")
    return result


# ------------------------------------------------------------ the chart


def sweep(options: BenchOptions) -> list[Point]:
    """Every format at several sizes, for ``--plot``: tokens 16 … 2048."""
    if options.tiny:
        steps, repeat = [4, 8], 1
    elif options.quick:
        steps, repeat = [16, 128, 1024], 1
    else:
        steps, repeat = [16, 64, 256, 1024, 2048], 3
    points: list[Point] = []
    for tokens in steps:
        options.progress(f"plot: [1, {tokens}, {HIDDEN}] float32, {repeat} repeats")
        points += anyio.run(measure, tokens, repeat, backend=options.async_backend)
    return points

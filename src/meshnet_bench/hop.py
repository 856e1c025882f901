"""One node hop against the raw socket it runs on.

A 64 MiB bfloat16 activation, identity body, sent to a real ``meshnet-node``
process (last stage, echo): the node reads and decodes it, runs the stage
and answers it back. The baseline is the same bytes sent to, and echoed
by, a plain length-prefixed TCP echo process (:mod:`meshnet_bench._raw_echo`)
on the same loopback, by the same kind of client (anyio, reads of up to
1 MiB into one buffer). Round trips are interleaved (raw, node, raw, …)
and the medians compared; answers are checked bit-identical.

Key: ``hop_over_raw_throughput`` (node MB/s ÷ raw MB/s).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import anyio
import numpy as np

from meshnet_bench.activations import make_activation
from meshnet_proto import ActivationResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool

from . import _raw_echo
from ._result import BenchOptions, SectionResult
from ._support import QUIET, MiB, interleaved, median, mib, ms, rate_mb_s, ratio, server_process

KEYS = ("hop_over_raw_throughput",)

HIDDEN = 4096


async def _node_round_trip(
    pool: DownstreamPool, array: np.ndarray, body: memoryview, session: str
) -> memoryview:
    headers = WireHeaders(
        shape=array.shape,
        dtype="bfloat16",
        session=session,
        chunk_index=0,
        chunk_total=1,
        encoding="identity",
        position=0,
    )
    response = await pool.forward(headers, body, Deadline.after(120.0))
    if not isinstance(response, ActivationResponse):
        raise RuntimeError(f"the node answered an error: {response.error}")
    return memoryview(response.body)


async def _end_session(pool: DownstreamPool, session: str) -> None:
    """What a client done with a sequence does: the node drops the answer
    it kept for replay. Without it, every round trip (a new session each)
    pins 64 MiB until --max-stored-bytes (1 GiB) evicts, and on this shared
    machine fresh pages then cost the node 2-3x its round trip (section hop
    in docs/performance.md); the echo keeps nothing either."""
    answer = await pool.request("DELETE", f"/sessions/{session}", Deadline.after(30.0))
    if answer.status != 204:
        raise RuntimeError(f"the node did not end session {session}: {answer.status}")


async def measure(
    nbytes: int,
    repeat: int,
    node_url: str,
    raw_url: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    array = make_activation(nbytes // (HIDDEN * 2), HIDDEN)
    expected = array.reshape(-1).view(np.uint8)
    payload = expected.data
    host, port = raw_url.removeprefix("tcp://").rsplit(":", 1)
    pool = DownstreamPool(node_url, max_connections=1)
    async with await anyio.connect_tcp(host, int(port)) as raw:
        try:
            sessions = [str(uuid.uuid4())]

            async def node_call() -> memoryview:
                sessions.append(str(uuid.uuid4()))
                return await _node_round_trip(pool, array, payload, sessions[-1])

            async def after(name: str) -> None:
                if name == "node hop (identity)":
                    await _end_session(pool, sessions[-1])

            calls = {
                "raw TCP echo": lambda: _raw_echo.round_trip(raw, payload),
                "node hop (identity)": node_call,
            }

            def check(name: str, echoed: object) -> None:
                got = np.frombuffer(echoed, dtype=np.uint8)  # type: ignore[call-overload]
                if not np.array_equal(got, expected):
                    raise RuntimeError(f"{name}: the answer is not the payload")

            for name, call in calls.items():  # warm-up: connections open
                check(name, await call())
                await after(name)
            return await interleaved(calls, repeat, check, progress, after)
        finally:
            await pool.aclose()


def run(options: BenchOptions) -> SectionResult:
    if options.tiny:
        nbytes, repeat = 1 * MiB, 1
    else:
        nbytes, repeat = 64 * MiB, 3 if options.quick else 9
    options.progress(f"hop: one node hop vs raw TCP echo, {mib(nbytes)}, {repeat} interleaved")
    backend = ["--async-backend", options.async_backend]
    with (
        server_process("meshnet_node", *QUIET, *backend) as (_, node_url),
        server_process("meshnet_bench._raw_echo", *backend) as (_, raw_url),
    ):
        times = anyio.run(
            measure,
            nbytes,
            repeat,
            node_url,
            raw_url,
            options.progress,
            backend=options.async_backend,
        )
    raw, node = (median(times[name]) for name in ("raw TCP echo", "node hop (identity)"))
    result = SectionResult(
        title=f"one hop vs raw socket, {mib(nbytes)} bfloat16 identity, separate processes, "
        f"median of {repeat} round trips",
        keys={"hop_over_raw_throughput": ratio(raw, node)},
    )
    for name, seconds in (("raw TCP echo", raw), ("node hop (identity)", node)):
        result.rows.append(
            {
                "path": name,
                "round trip": ms(seconds),
                "MB/s": f"{rate_mb_s(nbytes, seconds):.0f}",
                "vs raw": f"{raw / seconds:.2f}x",
            }
        )
    return result

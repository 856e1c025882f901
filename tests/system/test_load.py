"""Load (issue 6): 64 concurrent sessions x 8 chunks through a gateway and two
nodes over loopback, with ``--inflight`` 1 and 4.

Every session sends its own random data, so an answer delivered to the wrong
session would not match bit for bit; both stages run ``--backend count``, so
a chunk lost or run twice shows in the per-(session, index, position) counts.
"""

from __future__ import annotations

from collections import Counter

import anyio
import numpy as np
import pytest

from meshnet_gateway import Client
from meshnet_node.backends import CountingStage
from support.gateway import activation, chain, chunks_counted, same_bits

pytestmark = pytest.mark.anyio

SESSIONS = 64
CHUNKS = 8
CHUNK_TOKENS = 4
HIDDEN = 32


# Each --inflight on one event loop, the pair covering both (the suite's time
# budget: 512 chunks through three servers on one core take seconds).
@pytest.mark.parametrize(
    ("anyio_backend", "inflight"), [("trio", 1), ("asyncio", 4)], ids=["trio-1", "asyncio-4"]
)
async def test_64_sessions_of_8_chunks_bit_exact_none_lost_or_doubled(inflight: int) -> None:
    inputs = [activation(CHUNKS * CHUNK_TOKENS, HIDDEN, seed=10_000 + i) for i in range(SESSIONS)]
    # Distinct data per session, or a mix-up could go unseen.
    assert len({bytes(a.view(np.uint8)) for a in inputs}) == SESSIONS
    gateway_flags = ["--chunk-tokens", str(CHUNK_TOKENS), "--inflight", str(inflight)]
    with anyio.fail_after(60):
        async with chain(2, node_flags=["--backend", "count"], gateway_flags=gateway_flags) as c:
            assert c.gateway.app.inflight == inflight
            results: list[object] = [None] * SESSIONS
            async with Client(c.gateway.url, max_connections=SESSIONS) as client:

                async def session(i: int) -> None:
                    results[i] = await client.forward(inputs[i], encoding="identity")

                async with anyio.create_task_group() as tg:
                    for i in range(SESSIONS):
                        tg.start_soon(session, i)
            expected: Counter[object] = Counter()
            for array, result in zip(inputs, results, strict=True):
                assert same_bits(result.output, array)  # type: ignore[attr-defined]
                sid = result.session  # type: ignore[attr-defined]
                expected.update((sid, k, k * CHUNK_TOKENS) for k in range(CHUNKS))
            assert len(expected) == SESSIONS * CHUNKS and set(expected.values()) == {1}
            for node in c.nodes:
                assert isinstance(node.app.stage, CountingStage)
                assert node.app.stage.runs == expected  # each chunk exactly once, no stranger
            ok = chunks_counted(c.gateway.app, "ok")
            assert ok == SESSIONS * CHUNKS

"""The reorder timeout on a real node over loopback (issue 19; the core's
rules and a simulated node are tests/proto/test_reorder_timer.py).

A chunk queued behind other sessions' compute is not lost: its wait in the
stage does not run its session's reorder timer. A chunk whose predecessor
never comes still times out while other sessions compute. The tests meet
the node on events (the chunks its table told to wait, a stage held shut
until the test opens it), never on a sleep or a measured time.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

from meshnet_node import RunningNode, serve_node
from meshnet_node.backends import stub_identity
from meshnet_node.config import NodeConfig
from meshnet_proto import ActivationResponse, ErrorResponse, WireHeaders, encode_for_wire
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.waiting import Waits, wait_until

TOKENS = 4


class OneAtATime:
    """An echo stage that computes one chunk at a time, like one accelerator:
    a chunk admitted to the stage queues behind other sessions' chunks. Each
    chunk takes ``seconds``, and none ends while ``gate`` is shut."""

    name = "one-at-a-time"

    def __init__(self, seconds: float) -> None:
        self.calls = 0
        self.seconds = seconds
        self.lock = anyio.Lock()
        self.gate = anyio.Event()
        self.gate.set()

    async def __call__(self, tensor: np.ndarray, context: Any = None) -> np.ndarray:
        self.calls += 1
        async with self.lock:
            await self.gate.wait()
            await anyio.sleep(self.seconds)  # stall under test: a chunk's compute
        return tensor

    def end_session(self, session: str) -> None:
        """Stateless."""

    def check_head(self, shape: tuple[int, ...], dtype: str, position: int | None = None) -> None:
        """Any tensor goes."""

    def bind_metrics(self, registry: Any) -> None:
        """No gauges of its own."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def kv_store(self) -> None:
        """Stateless: no KV to hand off."""
        return None

    def identity(self) -> dict[str, Any]:
        return stub_identity(self.name)


@asynccontextmanager
async def slow_node(stage: OneAtATime, *args: str) -> AsyncIterator[RunningNode]:
    config = NodeConfig.load(["--port", "0", *args], {})
    async with serve_node(config, stage=stage) as node:
        yield node


async def forward(
    pool: DownstreamPool, session: str, index: int, total: int
) -> ActivationResponse | ErrorResponse:
    array = np.full((1, TOKENS, 4), index, dtype="<f4")
    dtype, enc, body = encode_for_wire(array, encoding_policy="identity")
    headers = WireHeaders(shape=array.shape, dtype=dtype, session=session, chunk_index=index,
                          chunk_total=total, encoding=enc, position=TOKENS * index)  # fmt: skip
    return await pool.forward(headers, body, Deadline.after(30.0))


@pytest.mark.anyio
async def test_chunks_queued_for_compute_longer_than_the_reorder_timeout_are_served() -> None:
    """Issue 19's shape: two sessions send 4 chunks each to a node that
    computes one at a time, 0.3 s each, with a 0.6 s reorder timeout; chunks
    3, 1, 2 arrive first and wait, then chunks 0: the last chunk queues
    for about 2.4 s, four reorder timeouts, and every chunk is answered."""
    sessions = [str(uuid.uuid4()) for _ in range(2)]
    answers: dict[tuple[str, int], ActivationResponse | ErrorResponse] = {}
    async with slow_node(OneAtATime(0.3), "--reorder-timeout", "0.6") as node:
        pool = DownstreamPool(node.url)
        waits = Waits(node.app.seq)

        async def send(session: str, index: int) -> None:
            answers[session, index] = await forward(pool, session, index, 4)

        async with anyio.create_task_group() as tg:
            for index in (3, 1, 2):
                for session in sessions:
                    tg.start_soon(send, session, index)
            await wait_until(lambda: waits.count == 6, "chunks 1 to 3 of both sessions waiting")
            for session in sessions:  # chunk 0 last: admitted after the others wait
                tg.start_soon(send, session, 0)
        await pool.aclose()
        assert node.app.sessions_with_waiters == 0
    for (_, index), answer in sorted(answers.items()):
        assert isinstance(answer, ActivationResponse), answer
        assert answer.headers.position == TOKENS * index
    assert len(answers) == 8


@pytest.mark.anyio
async def test_a_lost_chunk_still_times_out_while_other_sessions_compute() -> None:
    busy, stalled = str(uuid.uuid4()), str(uuid.uuid4())
    stage = OneAtATime(0.0)
    async with slow_node(stage, "--reorder-timeout", "0.2") as node:
        pool = DownstreamPool(node.url)
        assert isinstance(await forward(pool, stalled, 0, 4), ActivationResponse)
        busy_answers: list[ActivationResponse | ErrorResponse] = []

        async def send_busy(index: int) -> None:
            busy_answers.append(await forward(pool, busy, index, 4))

        stage.gate = anyio.Event()  # the other session's compute lasts until opened
        async with anyio.create_task_group() as tg:
            for index in range(4):
                tg.start_soon(send_busy, index)
            await wait_until(lambda: stage.calls == 1, "the busy session in the stage")
            answer = await forward(pool, stalled, 2, 4)  # chunk 1 never comes
            assert busy_answers == []  # timed out while the other session computed
            stage.gate.set()
        await pool.aclose()
    assert isinstance(answer, ErrorResponse)
    assert (answer.status, answer.error["code"]) == (409, "chunk_wait_timeout")
    assert "without progress" in answer.error["message"]
    assert all(isinstance(a, ActivationResponse) for a in busy_answers) and len(busy_answers) == 4

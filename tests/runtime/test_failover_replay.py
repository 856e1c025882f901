"""A failover's replay with chunks in flight (no sockets: replicas with fake pools).

The replica a session leaves may answer an earlier chunk of it while the
move's replay runs (a draining node finishes what it has). That chunk must
reach the new replica before the move is made, or every later chunk waits
there for it (409 chunk_wait_timeout: seen once in CI under load).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

from meshnet_proto import ActivationResponse, ErrorResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.history import HistoryStore
from meshnet_runtime.replicas.failover import REPLAY_PATH, Failover
from meshnet_runtime.replicas.placement import Placement
from meshnet_runtime.replicas.replica import Replica

pytestmark = pytest.mark.anyio

SESSION = str(uuid.UUID(int=7))


def _chunk(index: int) -> tuple[WireHeaders, bytes]:
    tensor = np.full((1, 2, 4), index, dtype=np.float32)
    headers = WireHeaders.for_array(tensor, session=SESSION, chunk_index=index,
                                    chunk_total=3, position=2 * index)  # fmt: skip
    return headers, tensor.tobytes()


def _ok(headers: WireHeaders, body: bytes) -> ActivationResponse:
    return ActivationResponse(status=200, headers=headers, body=body, tensor=None)


class FakePool:
    """Answers every forward 200 (or as ``answer`` says) and records it."""

    def __init__(self, url: str, answer: Callable[[WireHeaders, str], Any] | None = None) -> None:
        self.url = url
        self.answer = answer
        self.seen: list[tuple[int | None, str]] = []

    async def forward(self, headers: WireHeaders, body: Any, deadline: Deadline,
                      path: str = "/forward") -> Any:  # fmt: skip
        self.seen.append((headers.chunk_index, path))
        if self.answer is not None:
            answered = self.answer(headers, path)
            if answered is not None:
                return answered
        return _ok(headers, bytes(body))

    async def fetch_kv(self, session: str, deadline: Deadline, headers: Any = ()) -> Any:
        # A chunk of the session is still in flight here: its KV is not final.
        return ErrorResponse(status=409, error={"code": "session_busy", "message": "busy"},
                             raw=b"")  # fmt: skip


def _replica(pool: FakePool) -> Replica:
    return Replica(url=pool.url, source=pool.url, pool=pool, probe=pool)  # type: ignore[arg-type]


async def test_a_chunk_answered_by_the_old_replica_during_the_replay_is_replayed_too() -> None:
    history = HistoryStore(1 << 20)
    placement: Placement[Replica] = Placement(60.0, None)
    failover: Failover

    def holder_answer(headers: WireHeaders, path: str) -> Any:
        # Draining: chunk 2 is refused (chunk 1 is still in flight there).
        return ErrorResponse(status=503, error={"code": "shutting_down", "message": "bye"},
                             raw=b"")  # fmt: skip

    def other_answer(headers: WireHeaders, path: str) -> Any:
        if path == REPLAY_PATH and headers.chunk_index == 0:
            # While chunk 0 is replayed here, the old replica answers chunk 1
            # (in flight there when it began draining) and it joins the history.
            failover.keep(SESSION, *chunk_one, _ok(*chunk_one))
        return None

    holder_pool = FakePool("http://a", holder_answer)
    other_pool = FakePool("http://b", other_answer)
    holder, other = _replica(holder_pool), _replica(other_pool)
    placement.add(holder)
    placement.add(other)
    failover = Failover("a,b", placement, history, None, 1.0)  # type: ignore[arg-type]
    chunk_zero, chunk_one, chunk_two = _chunk(0), _chunk(1), _chunk(2)
    failover.keep(SESSION, *chunk_zero, _ok(*chunk_zero))
    placement.sticky[SESSION] = holder

    with anyio.fail_after(10):
        response = await failover.recover(SESSION, *chunk_two, Deadline.after(5), holder,
                                          alive=False)  # fmt: skip

    assert isinstance(response, ActivationResponse) and response.headers.chunk_index == 2
    assert placement.sticky[SESSION] is other
    # The new replica has every chunk before chunk 2, in order, before chunk 2.
    assert other_pool.seen == [(0, REPLAY_PATH), (1, REPLAY_PATH), (2, "/forward")]
    assert failover.replayed_chunks == 2 and failover.failovers == 1
    # It drains (503): its KV was asked for first, and was not final (409 session_busy).
    assert failover.handoffs.failed == 1 and failover.handoffs.moved == 0

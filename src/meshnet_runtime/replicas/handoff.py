"""Moving a session between replicas by its KV (wire-2 §3.11, §3.12).

``hand_off`` is the sender's sequence: export from the replica that holds
the session, import at the new one, then end it at the old one only
(``DELETE ?replay=1``). ``disaggregated_target`` is the prefill/decode rule:
a session's first one-token chunk at a prefill replica moves it to the
least loaded decode replica. A move that fails leaves the session where it
was; the caller then goes on there, or replays (docs/failover.md).
``MoveBackoff`` keeps a session whose prefill/decode move failed from trying
again on every decode step: each try of its KV costs a whole export.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from meshnet_proto import ActivationResponse, ErrorResponse, MeshnetError, WireHeaders

from ..deadlines import Deadline
from ..downstream import key_headers
from .placement import Placement
from .replica import Replica

__all__ = [
    "KV_IMPORT_PATH",
    "HandoffCounts",
    "MoveBackoff",
    "disaggregated_target",
    "hand_off",
]

log = logging.getLogger("meshnet.replicas")

KV_IMPORT_PATH = "/forward?kv=1"


@dataclass(slots=True)
class HandoffCounts:
    """What the set's moves by KV did (``/info`` replicas.handoff, /metrics)."""

    moved: int = 0  # sessions moved with no replay
    failed: int = 0  # moves tried and given up (the session stayed, or replayed)
    bytes: int = 0  # KV bytes carried


async def hand_off(
    source: Replica,
    target: Replica,
    session: str,
    key: str | None,
    deadline: Deadline,
    counts: HandoffCounts,
    *,
    ask: Deadline | None = None,
    backoff: MoveBackoff | None = None,
) -> bool:
    """Move ``session`` from ``source`` to ``target`` by its KV; whether it moved.

    ``ask``: the deadline of the export (a source that may be gone is given
    less than the whole move); ``backoff``: told of the outcome. The caller
    holds the session's lock: none of its chunks is in flight."""
    why = ""
    try:
        exported = await source.pool.fetch_kv(session, ask or deadline, key_headers(key))
        if isinstance(exported, ErrorResponse):
            why = f"export: {exported.status} {exported.error.get('code')}"
        else:
            imported = await target.pool.request(
                "POST",
                KV_IMPORT_PATH,
                deadline,
                _import_headers(exported, key),
                bytes(exported.body),
            )
            if imported.status != 200:
                code = imported.error.get("code") if isinstance(imported, ErrorResponse) else ""
                why = f"import: {imported.status} {code}"
    except MeshnetError as exc:
        why = f"{exc.code}: {exc}"
    if backoff is not None:
        (backoff.failed if why else backoff.forget)(session)
    if why:
        counts.failed += 1
        log.warning(
            "session %s: no KV hand-off from %s to %s (%s)", session, source.url, target.url, why
        )
        return False
    assert isinstance(exported, ActivationResponse)
    # Ended there only: the stages below keep theirs (wire-2 §3.8). If it
    # fails, the old copy ends by its TTL; the session is the new one's now.
    with contextlib.suppress(MeshnetError):
        await source.pool.request(
            "DELETE", f"/sessions/{session}?replay=1", deadline, key_headers(key)
        )
    counts.moved += 1
    counts.bytes += memoryview(exported.body).nbytes
    log.info(
        "session %s: handed off from %s to %s by its KV (%d bytes)",
        session,
        source.url,
        target.url,
        memoryview(exported.body).nbytes,
    )
    return True


def _import_headers(exported: ActivationResponse, key: str | None) -> list[tuple[bytes, bytes]]:
    """The export's headers as received, with the session's key (an answer never carries it)."""
    headers: WireHeaders = exported.headers.replace(session_key=key)
    return headers.to_pairs()


class MoveBackoff:
    """When a session may try its prefill/decode move again after one failed.

    A refused move (the decode replica's KV budget or transfer places full,
    an export that failed) is tried again only after ``first`` seconds,
    doubling to ``longest``; after ``give_up`` failures the session stays
    where it is for good (its answers are the same there). At most ``limit``
    sessions are remembered (the oldest forgotten first), so a set with many
    short sessions that fail to move holds bounded memory."""

    def __init__(
        self,
        *,
        first: float = 1.0,
        longest: float = 30.0,
        give_up: int = 8,
        limit: int = 65536,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self.first, self.longest, self.give_up, self.limit = first, longest, give_up, limit
        self.clock = clock
        self._failed: dict[str, tuple[int, float]] = {}  # session: (failures, next try at)

    def due(self, session: str) -> bool:
        """Whether the session may try a move now."""
        failed = self._failed.get(session)
        if failed is None:
            return True
        failures, at = failed
        return failures < self.give_up and self.clock() >= at

    def failed(self, session: str) -> None:
        failures = self._failed.pop(session, (0, 0.0))[0] + 1
        wait = min(self.first * 2 ** (failures - 1), self.longest)
        self._failed[session] = (failures, self.clock() + wait)
        if len(self._failed) > self.limit:
            del self._failed[next(iter(self._failed))]

    def forget(self, session: str) -> None:
        """The session moved or ended: nothing to wait for."""
        self._failed.pop(session, None)


def disaggregated_target(
    placement: Placement[Replica],
    holder: Replica,
    headers: WireHeaders,
    backoff: MoveBackoff | None = None,
) -> Replica | None:
    """The decode replica a session at a prefill replica moves to before this
    chunk (wire-2 §3.12): its first one-token chunk, when a healthy decode
    replica is there and no failed move of it is being backed off from
    (``backoff``); else None (it stays)."""
    if holder.kv_role != "prefill" or headers.tokens != 1 or headers.starts_session:
        return None
    if backoff is not None and headers.session is not None and not backoff.due(headers.session):
        return None
    decoders: Sequence[Replica] = [
        r for r in placement.ranked(exclude=[holder], fallback=False) if r.kv_role == "decode"
    ]
    return decoders[0] if decoders else None

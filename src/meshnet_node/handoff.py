"""A node's side of the KV hand-off (wire-2 §3.11, §3.12).

``KVStore`` is what a stage with per-session KV offers (``ModelStage``); a
stub stage has none (409 ``kv_unsupported``). ``check_import_head`` is the
import's head, in the spec's order, up to the bytes to set aside
(pre-allocation); ``export_message`` builds the export's answer. The
``NodeApp`` wires them to the session table and the routes.

Every byte a move makes the node hold is bounded before it is held
(``kv_transfers``): a place among the moves open at once (per peer and in
all), the import's bytes in the KV budget until a short body deadline
(``--kv-import-timeout``), the export's copy in the server's in-flight
budget until its answer is written or its client is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from meshnet_proto import (
    EndpointRequest,
    ErrorCode,
    ProtocolError,
    SequencingError,
    SessionTable,
    WireHeaders,
    encode_tensor,
)
from meshnet_proto.lowlevel import AfterSpec, ByteBudget, kv_checksum, parse_session_key
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.http_server import ActivationReply, Reply, RequestContext

from .kv_transfers import KVTransfers, check_finite

__all__ = [
    "HeldBytes",
    "KVHandoff",
    "KVLayout",
    "KVStore",
    "check_checksum",
    "check_kv_body",
    "check_import_head",
    "export_message",
    "handoff_info",
    "kv_unsupported",
]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV message for this stage must be: ``[layers, 2, batch,
    kv_heads, positions, head_dim]`` of ``dtype``, positions up to ``max_context``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_position: int  # at batch 1
    max_context: int
    max_batch: int


class KVStore(Protocol):
    """A stage's sessions' KV, as the hand-off needs it."""

    @property
    def kv_layout(self) -> KVLayout: ...

    def kv_free_bytes(self) -> int: ...

    def hold_kv(self, nbytes: int) -> None:
        """Set ``nbytes`` aside (503 ``kv_memory_full`` when they do not fit)."""

    def release_kv(self, nbytes: int) -> None: ...

    async def export_kv(self, session: str) -> np.ndarray | None:
        """A copy of the session's KV, or None when it holds none."""

    async def import_kv(self, session: str, state: np.ndarray, held: int) -> None:
        """Give the new session ``state`` (``held`` bytes were set aside for it)."""


def kv_unsupported(what: str) -> SequencingError:
    return SequencingError(
        f"{what}: this stage keeps no per-session KV (a stub): nothing to hand off",
        code=ErrorCode.KV_UNSUPPORTED,
    )


def _bad_kv(message: str, header: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_KV, header=header)


class HeldBytes:
    """Bytes an import's head set aside: taken by the import, or given back
    when the request ends without one (a body that never came)."""

    def __init__(self, store: KVStore, nbytes: int) -> None:
        self.store = store
        self.nbytes = nbytes

    def take(self) -> int:
        nbytes, self.nbytes = self.nbytes, 0
        return nbytes

    def __call__(self) -> None:
        if self.nbytes:
            self.store.release_kv(self.take())


def check_import_head(
    store: KVStore | None,
    fingerprint: str,
    headers: WireHeaders,
    table: SessionTable,
    now: float,
    client: str | None,
) -> int:
    """wire-2 §3.11's checks of an import's head, after the core's (§2 and
    the KV headers): the fingerprint, the shape, the table; then the bytes
    to set aside (``KVHandoff.check_head`` holds them, last)."""
    if store is None:
        raise kv_unsupported("a KV import")
    if headers.kv_fingerprint != fingerprint:
        raise SequencingError(
            f"the KV was exported by stage {headers.kv_fingerprint}; this node is {fingerprint} "
            "(another stage, or the same on another engine or dtype)",
            code=ErrorCode.STAGE_MISMATCH,
            header="x-meshnet-kv-fingerprint",
        )
    layout = store.kv_layout
    layers, _, batch, heads, positions, head_dim = headers.shape  # axis 1: core-checked
    if (layers, heads, head_dim) != (layout.layers, layout.kv_heads, layout.head_dim) or not (
        1 <= batch <= layout.max_batch
    ):
        raise _bad_kv(
            f"this stage's KV is [{layout.layers}, 2, 1..{layout.max_batch}, {layout.kv_heads}, "
            f"positions, {layout.head_dim}]; got {list(headers.shape)}",
            "x-meshnet-shape",
        )
    if headers.dtype != layout.dtype:
        raise _bad_kv(f"this stage's KV is {layout.dtype}, not {headers.dtype}", "x-meshnet-dtype")
    if positions > layout.max_context:
        raise _bad_kv(
            f"{positions} positions is past this stage's context of {layout.max_context}",
            "x-meshnet-position",
        )
    if headers.after is not None and headers.after.position != headers.position:
        raise ProtocolError(
            f"x-meshnet-after: a KV import follows its own {headers.position} positions, "
            f"not {headers.after.position} (wire-2 §3.16)",
            code=ErrorCode.BAD_AFTER,
            header="x-meshnet-after",
        )
    assert headers.session is not None  # a node's parse requires it
    table.check_adopt(headers.session, now, client=client)
    return layout.bytes_per_position * batch * positions


def import_epoch(headers: WireHeaders) -> int:
    """The epoch an import's session goes on in (wire-2 §3.16): the one its
    export carried, 0 without ``X-Meshnet-After`` (an exporter before
    §3.16, or a session that never rewound)."""
    return 0 if headers.after is None else headers.after.epoch


def check_checksum(headers: WireHeaders, tensor: np.ndarray) -> None:
    if kv_checksum(tensor) != headers.kv_checksum:
        raise _bad_kv(
            "the KV's bytes do not match x-meshnet-kv-checksum (XXH3-64): nothing was imported",
            "x-meshnet-kv-checksum",
        )


def check_kv_body(headers: WireHeaders, tensor: np.ndarray) -> None:
    """The import's body (off the loop): its checksum, then its numbers."""
    check_checksum(headers, tensor)
    check_finite(tensor)


def export_message(
    session: str, state: np.ndarray, fingerprint: str, epoch: int = 0
) -> tuple[WireHeaders, bytes | memoryview]:
    """The export's 200: the KV message (identity encoding: KV numbers
    compress poorly, and a hand-off is one message), with the session's
    epoch (wire-2 §3.16: ``X-Meshnet-After: position=S,epoch=e``)."""
    position = int(state.shape[4])
    headers = WireHeaders.for_array(
        state,
        session=session,
        chunk_index=0,
        chunk_total=1,
        position=position,
        kv_checksum=kv_checksum(state),
        kv_fingerprint=fingerprint,
        after=AfterSpec(position, epoch),
    )
    return headers, encode_tensor(state, encoding="identity")


def handoff_info(
    store: KVStore | None, role: str, transfers: KVTransfers | None = None
) -> dict[str, Any] | None:
    """``/info``'s ``handoff`` object (wire-2 §3.12): the registration a
    replica set reads, and the moves open here."""
    if store is None:
        return None
    layout = store.kv_layout
    info: dict[str, Any] = {
        "role": role,
        "kv_dtype": layout.dtype,
        "bytes_per_position": layout.bytes_per_position,
        "kv_free_bytes": store.kv_free_bytes(),
    }
    if transfers is not None:
        info["transfers"] = transfers.describe()
    return info


class KVHandoff:
    """The node's hand-off routes over its session table and stage:
    ``check_head`` and ``import_`` for ``POST /forward?kv=1``, ``export``
    for ``GET /kv/{id}``, ``held`` for a drain (wire-2 §3.11)."""

    def __init__(
        self,
        table: SessionTable,
        store: KVStore | None,
        fingerprint: str,
        *,
        end_session: Callable[[str], None],
        codecs: CodecPool,
        registry: CollectorRegistry,
        transfers: KVTransfers | None = None,
        import_timeout: float | None = None,
    ) -> None:
        self.table = table
        self.store = store
        self.fingerprint = fingerprint
        self.end_session = end_session  # the stage's: an import the table then refused
        self.codecs = codecs
        # Moves open at once, per peer and in all (--max-kv-transfers[-per-peer]).
        self.transfers = transfers or KVTransfers(4, 2)
        # An import's body must arrive this soon after its head (--kv-import-timeout):
        # its bytes are set aside meanwhile. None: the server's body timeout.
        self.import_timeout = import_timeout
        # The server's in-flight budget (serving.build_node), where an export's
        # copy counts while its answer is written; None: not counted (a bare app).
        self.inflight: ByteBudget | None = None
        self._importing: set[str] = set()
        self.moved = Counter(
            "meshnet_handoff_sessions",
            "Sessions' KV exported or imported (wire-2 §3.11)",
            ["direction"],
            registry=registry,
        )
        self.moved_bytes = Counter(
            "meshnet_handoff_bytes",
            "KV bytes exported or imported",
            ["direction"],
            registry=registry,
        )

    def held(self) -> int:
        """Sessions a drain keeps for export (none without KV)."""
        return len(self.table) if self.store is not None else 0

    def _not_importing(self, session: str) -> None:
        if session in self._importing:
            raise SequencingError(
                f"session {session} is being imported here already",
                code=ErrorCode.SESSION_EXISTS,
                header="x-meshnet-session",
            )

    def info(self, role: str) -> dict[str, Any] | None:
        return handoff_info(self.store, role, self.transfers)

    def check_head(self, headers: WireHeaders, ctx: RequestContext) -> None:
        """The import's head: its checks, then a place among the moves, then
        its bytes set aside; all given back when the request ends without
        the import (ctx.cleanups), at the latest at its body's deadline."""
        assert headers.session is not None
        self._not_importing(headers.session)
        nbytes = check_import_head(
            self.store, self.fingerprint, headers, self.table, anyio.current_time(), ctx.peer
        )
        assert self.store is not None  # check_import_head refused a stub
        ctx.cleanups.append(self.transfers.take(ctx.peer, "a KV import"))
        self.store.hold_kv(nbytes)
        ctx.cleanups.append(HeldBytes(self.store, nbytes))
        if self.import_timeout is not None:
            ctx.body_timeout = self.import_timeout

    async def import_(self, headers: WireHeaders, tensor: np.ndarray, ctx: RequestContext) -> Reply:
        """The import's body: checksum, then the stage's cache, then the table."""
        session, position = headers.session, headers.position
        assert session is not None and position is not None and self.store is not None
        (held,) = (c for c in ctx.cleanups if isinstance(c, HeldBytes))
        await self.codecs.run(headers.nbytes, check_kv_body, headers, tensor)
        self._not_importing(session)
        self.table.check_adopt(session, anyio.current_time(), client=ctx.peer)
        self._importing.add(session)
        try:
            await self.store.import_kv(session, tensor, held.take())
            try:
                self.table.adopt(
                    session,
                    position,
                    anyio.current_time(),
                    key=headers.session_key,
                    client=ctx.peer,
                    epoch=import_epoch(headers),
                )
            except BaseException:
                self.end_session(session)
                raise
        finally:
            self._importing.discard(session)
        self.moved.labels("import").inc()
        self.moved_bytes.labels("import").inc(tensor.nbytes)
        return Reply.json(200, {"session": session, "position": position, "bytes": tensor.nbytes})

    async def export(self, event: EndpointRequest, ctx: RequestContext) -> ActivationReply:
        """``GET /kv/{id}``: the session's KV message; nothing changes here."""
        session = event.path.removeprefix("/kv/")
        self.table.check_owner(session, parse_session_key(event.headers))
        if session not in self.table:
            raise ProtocolError(f"session {session} is unknown here", code=ErrorCode.NOT_FOUND)
        if self.store is None:
            raise kv_unsupported(f"GET /kv/{session}")
        position = self.table.position(session)
        if not self.table.between_runs(session, anyio.current_time()):
            raise _busy(session)
        ctx.cleanups.append(self.transfers.take(ctx.peer, f"GET /kv/{session}"))
        # The copy is held until its answer is written or its client is gone:
        # counted from before it is made, at a batch-1 session's size (a
        # session's usual batch), the rest once it is known.
        expected = (position or 0) * self.store.kv_layout.bytes_per_position
        self._hold_copy(expected, ctx)
        state = await self.store.export_kv(session)
        if state is None:
            raise ProtocolError(
                f"session {session} holds no KV here (no position computed)",
                code=ErrorCode.NOT_FOUND,
            )
        # A chunk that ran meanwhile (its sender broke the rule) changed what was copied.
        if self.table.position(session) != position or state.shape[4] != position:
            raise _busy(session)
        if state.nbytes > expected:
            self._hold_copy(state.nbytes - expected, ctx)
        epoch = self.table.epoch(session) or 0
        headers, body = export_message(session, state, self.fingerprint, epoch)
        self.moved.labels("export").inc()
        self.moved_bytes.labels("export").inc(state.nbytes)
        return ActivationReply(headers, body)

    def _hold_copy(self, nbytes: int, ctx: RequestContext) -> None:
        """``nbytes`` of an export's copy in the in-flight budget (503
        ``memory_full`` past it), given back when the request ends."""
        if self.inflight is not None:
            ctx.cleanups.append(self.inflight.reserve(nbytes).release)


def _busy(session: str) -> SequencingError:
    return SequencingError(
        f"session {session} has a run open or a chunk in flight: its KV is not final",
        code=ErrorCode.SESSION_BUSY,
        header="x-meshnet-session",
    )

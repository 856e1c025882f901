"""Every limit of the core, in one validated, immutable object.

Each default says where it comes from. All sizes are bytes, all times seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Limits"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    # 16 KiB: h11's own default for an incomplete event, and in the range of
    # nginx (8-32 KiB) and Apache (8 KiB per line). Wire-2 heads are < 1 KiB.
    max_header_bytes: int = 16 * KiB
    # 512 MiB (wire-2 §2): a 2048-token prefill at hidden 16384 in float32 is
    # 128 MiB, so this leaves room for larger stages without letting a single
    # header make a node allocate its whole memory.
    max_tensor_bytes: int = 512 * MiB
    # wire-2 §2: 1..8 dimensions.
    max_rank: int = 8
    # A run of more than 65536 chunks is a client bug, not a sequence: even at
    # one token per chunk it is a 64k context.
    max_chunk_total: int = 65536
    # wire-2 §3 defaults.
    max_sessions: int = 1024
    session_ttl: float = 600.0
    reorder_window: int = 16
    reorder_timeout: float = 10.0
    # Success responses kept for replay (wire-2 §3), over all sessions. Without
    # a budget, max_sessions x 2 x (reorder_window + 1) x max_tensor_bytes is
    # held by peers' say-so; past it the oldest stored answers are dropped.
    max_stored_bytes: int = 1024 * MiB
    # Tensor bytes held for requests in flight, all connections together
    # (ByteBudget): 4 x max_tensor_bytes lets four maximal requests (or many
    # chunk-sized ones) in at once while 256 legal connections cannot add up
    # to 128 GiB. Past it a new request head gets 503 memory_full.
    max_inflight_bytes: int = 2048 * MiB
    # Sessions one client (the peer's host) may hold (wire-2 §3.9): half the
    # table by default (None follows max_sessions), so one peer cannot fill
    # it for every other; 0 turns the quota off.
    max_sessions_per_client: int | None = None

    def __post_init__(self) -> None:
        if self.max_sessions_per_client is None and isinstance(self.max_sessions, int):
            object.__setattr__(self, "max_sessions_per_client", self.max_sessions // 2)
        for name in (
            "max_header_bytes",
            "max_tensor_bytes",
            "max_rank",
            "max_chunk_total",
            "max_sessions",
            "reorder_window",
            "max_stored_bytes",
            "max_inflight_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        quota = self.max_sessions_per_client
        if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
            raise ValueError(
                f"Limits.max_sessions_per_client must be a non-negative int, got {quota!r}"
            )
        if self.max_rank > 8:
            raise ValueError("Limits.max_rank cannot exceed 8 (wire-2 §2)")
        for name in ("session_ttl", "reorder_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """Every limit by name: what ``GET /info`` shows (wire-2 §6)."""
        return asdict(self)

"""A session's KV out of one runner and into another of the same stage
(wire-2 §3.11's hand-off, at the model): bit for bit, under the KV budget.

The caller makes sure no chunk of the session computes meanwhile (the
node's session table: only a session between runs is exported).
"""

from __future__ import annotations

import numpy as np

from .runner import StageRunner

__all__ = ["export_kv", "import_kv", "kv_layout"]


def kv_layout(runner: StageRunner) -> tuple[int, int, int, str, int]:
    """``(layers, kv_heads, head_dim, dtype, bytes per position at batch 1)``
    of the stage's KV: what a KV message for it must be."""
    probe = runner.model.new_cache(runner.budget, 1)  # allocates nothing
    return (
        probe.layers,
        probe.kv_heads,
        probe.head_dim,
        probe.dtype_name,
        probe.bytes_per_position,
    )


def export_kv(runner: StageRunner, session: str) -> np.ndarray | None:
    """A copy of the session's KV (``KVCache.export_state``), or None when it holds none."""
    cache = runner.cache_of(session)
    if cache is None or cache.length == 0:
        return None
    return cache.export_state()


def import_kv(runner: StageRunner, session: str, state: np.ndarray, *, held: int = 0) -> None:
    """Give ``session`` (new here) the cache ``state`` holds. ``held``: the
    bytes the import's head set aside (``KVBudget.hold``), given back as the
    cache takes its own. ``KVBudgetExceeded`` when it cannot fit,
    ``ValueError`` for a state not of this stage or a session that has a
    cache; nothing is left behind either way."""
    cache = runner.model.new_cache(runner.budget, int(state.shape[2]))
    if held:
        runner.budget.release(held)
    try:
        cache.import_state(state)
        runner.give_cache(session, cache)
    except BaseException:
        cache.close()
        raise

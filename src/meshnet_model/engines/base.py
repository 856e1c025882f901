"""The ``Engine`` protocol: what a ``StageRunner`` needs of a compute engine.

Generic over the engine's cache type: the numpy ``StageModel`` makes and
takes a ``KVCache``, the torch engine a ``TorchKVCache`` (a ``KVCache`` whose
arrays live on the device), and each ``forward`` takes only the caches its own
``new_cache`` made. The runner holds any engine (``Engine[Any]``) and uses only
what ``KVCache`` has (``batch``, ``length``, ``truncate``, ``close``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..stage.batch import BatchEntry, PackedBatch
from ..stage.kv_cache import KVBudget, KVCache

__all__ = ["CacheT", "Engine"]

CacheT = TypeVar("CacheT", bound=KVCache)


@runtime_checkable
class Engine(Protocol[CacheT]):
    """What the runner needs of an engine: it owns the weights, a session's
    cache arrays (``new_cache``) and the forward pass; numpy in, numpy out.
    ``forward`` calls ``between_layers`` before each layer (the runner's
    deadline and session-life check, which may raise to stop the compute)."""

    def new_cache(self, budget: KVBudget, batch: int) -> CacheT: ...

    def forward(
        self,
        inputs: np.ndarray,
        cache: CacheT,
        position: int,
        *,
        between_layers: Callable[[], None] | None = None,
    ) -> np.ndarray: ...

    def forward_batch(self, entries: Sequence[BatchEntry[CacheT]]) -> PackedBatch[CacheT]:
        """Several sessions' chunks in one pass (``stage.batch``); each entry
        ends with its ``output`` or its ``error``."""
        ...

    def describe(self) -> dict[str, Any]: ...

    # Query rows scored at once (costs.chunk_cost; None: the whole chunk).
    query_block: int | None
    # Whether every product computes each row on its own, so batched entries
    # share them and chunks may be cut into pieces (stage.batch).
    row_invariant: bool
    # Positions in the aligned blocks its fixed-shape products take whole (a
    # quantized torch stage's dense tiles): no piece of a chunk ends inside one
    # that lies wholly in the chunk; None: no such blocks.
    piece_tile: int | None

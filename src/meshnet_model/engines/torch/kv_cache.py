"""A session's keys and values on the engine's device, in its compute dtype.

The budget logic is the numpy ``KVCache``'s (one ``KVBudget`` per stage, the
allocated capacity counted, 503 ``kv_memory_full`` when a chunk cannot fit,
``SessionEnded`` for a cache closed mid-chunk); this subclass only says what
an element costs and allocates device tensors. Capacity is always a whole
number of blocks (``BLOCK`` positions): a session's cache is preallocated a
block at a time and grows by doubling, so decode steps write into memory that
is already there instead of allocating per token.
"""

from __future__ import annotations

from typing import Any

from ...stage.kv_cache import KVBudget, KVCache
from .transfer import Staging

__all__ = ["BLOCK", "TorchKVCache"]

BLOCK = 64  # positions per allocation unit


class TorchKVCache(KVCache):
    def __init__(self, torch: Any, budget: KVBudget, *, layers: int, batch: int,
                 kv_heads: int, head_dim: int, dtype: Any, device: Any) -> None:  # fmt: skip
        super().__init__(budget, layers=layers, batch=batch, kv_heads=kv_heads,
                         head_dim=head_dim)  # fmt: skip
        self.torch, self.dtype, self.device = torch, dtype, device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        # The session's device->host buffers (CUDA; None on the CPU): they
        # live and die with the session, as its cache does.
        self.staging: Staging | None = None

    def reserve(self, needed: int) -> None:
        super().reserve(-(-needed // BLOCK) * BLOCK)

    def _allocate(self, capacity: int) -> None:
        t = self.torch
        shape = (self.batch, self.kv_heads, capacity, self.head_dim)
        filled = self.length
        keys, values = [], []
        for layer in range(self.layers):
            k = t.empty(shape, dtype=self.dtype, device=self.device)
            v = t.empty(shape, dtype=self.dtype, device=self.device)
            if filled:
                k[:, :, :filled] = self.keys[layer][:, :, :filled]
                v[:, :, :filled] = self.values[layer][:, :, :filled]
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values

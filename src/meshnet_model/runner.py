"""One stage's model with the KV caches of its sessions: what a node runs.

``StageRunner.run(session, position, inputs)`` checks a chunk against the
stage's contract, finds (or makes) the session's cache and runs the layers.
It is synchronous and safe to call from worker threads for different
sessions at once; the caller guarantees that one session's chunks come one
at a time, in order (the node's sequencer does).

Position handling — the cache must agree with the session's position (SPEC
§3: the node's count of tokens taken in):

* cache longer than the position: a chunk whose compute finished but whose
  run was then reported failed or cancelled left positions behind; they are
  dropped and the chunk recomputed (the retransmission's numbers are then
  exactly the first attempt's).
* cache shorter: context this stage never saw — refused (``CacheMismatch``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .config import ModelConfig
from .kv_cache import KVBudget, KVCache
from .llama import StageModel
from .source import model_name
from .weights import StageWeights

__all__ = ["CacheMismatch", "Engine", "StageInputError", "StageRunner"]

DEFAULT_KV_BUDGET = 1024 * 1024 * 1024
_FLOAT_WIRE = ("float32", "float16", "bfloat16")


class Engine(Protocol):
    """What the runner needs of an engine: it owns the weights, a session's
    cache arrays (``new_cache``) and the forward pass; numpy in, numpy out."""

    def new_cache(self, budget: KVBudget, batch: int) -> KVCache: ...

    def forward(self, inputs: np.ndarray, cache: KVCache, position: int) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


class StageInputError(ValueError):
    """A chunk this stage cannot take (wrong dtype, rank, width, token id)."""


class CacheMismatch(Exception):
    """The session's cache does not hold the context the chunk follows."""


class StageRunner:
    def __init__(
        self,
        weights: StageWeights,
        *,
        kv_budget_bytes: int = DEFAULT_KV_BUDGET,
        name: str | None = None,
        path: str | None = None,
        model: Engine | None = None,
    ) -> None:
        self.weights = weights
        # The engine: numpy's StageModel unless another is given (the torch one).
        self.model: Engine = model if model is not None else StageModel(weights)
        self.config: ModelConfig = weights.config
        self.budget = KVBudget(kv_budget_bytes)
        self.name = name
        self.path = path
        self._caches: dict[str, KVCache] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        directory: str | Path,
        layers: range | None = None,
        *,
        dtype: str = "float32",
        kv_budget_bytes: int = DEFAULT_KV_BUDGET,
    ) -> StageRunner:
        path = Path(directory)
        weights = StageWeights.load(path, layers, dtype=dtype)
        return cls(weights, kv_budget_bytes=kv_budget_bytes, name=model_name(path),
                   path=str(path))  # fmt: skip

    # -- the contract --------------------------------------------------------------

    @property
    def first(self) -> bool:
        return self.weights.first

    @property
    def last(self) -> bool:
        return self.weights.last

    def check_shape(self, shape: tuple[int, ...], dtype: str) -> None:
        """Raise ``StageInputError`` unless a chunk of this shape and dtype (its
        wire name) is what this stage takes — the checks that need no values."""
        c = self.config
        if self.first:
            if dtype != "int32" or len(shape) != 2:
                raise StageInputError(
                    f"the stage owning layer 0 takes token ids: int32 [batch, tokens], got "
                    f"{dtype} {list(shape)}"
                )
            return
        if dtype not in _FLOAT_WIRE or len(shape) != 3 or shape[2] != c.hidden_size:
            raise StageInputError(
                f"layers {self.weights.layers.start}..{self.weights.layers.stop - 1} take "
                f"hidden states: float [batch, tokens, {c.hidden_size}], got {dtype} "
                f"{list(shape)}"
            )

    def check_input(self, inputs: np.ndarray) -> None:
        """Raise ``StageInputError`` unless ``inputs`` is what this stage takes."""
        self.check_shape(inputs.shape, inputs.dtype.name)
        vocab = self.config.vocab_size
        if self.first and inputs.size and (inputs.min() < 0 or inputs.max() >= vocab):
            raise StageInputError(
                f"token ids must be in 0..{vocab - 1}, got {inputs.min()}..{inputs.max()}"
            )

    def output_shape(self, inputs_shape: tuple[int, ...]) -> tuple[int, ...]:
        batch, tokens = inputs_shape[0], inputs_shape[1]
        if self.last:
            return (batch, self.config.vocab_size)
        return (batch, tokens, self.config.hidden_size)

    # -- running -------------------------------------------------------------------

    def run(self, session: str, position: int, inputs: np.ndarray) -> np.ndarray:
        self.check_input(inputs)
        cache = self._cache_for(session, batch=inputs.shape[0], position=position)
        if cache.batch != inputs.shape[0]:
            raise StageInputError(
                f"session {session} started with batch {cache.batch}, this chunk has "
                f"{inputs.shape[0]}"
            )
        if cache.length > position:
            cache.truncate(position)
        elif cache.length < position:
            raise CacheMismatch(
                f"session {session}: this stage's KV cache holds {cache.length} positions, "
                f"the chunk starts at {position}"
            )
        return self.model.forward(inputs, cache, position)

    def _cache_for(self, session: str, *, batch: int, position: int) -> KVCache:
        with self._lock:
            cache = self._caches.get(session)
            if cache is None:
                cache = self._caches[session] = self.model.new_cache(self.budget, batch)
            return cache

    def end_session(self, session: str) -> int:
        """Free the session's cache; returns the bytes given back (0 if none)."""
        with self._lock:
            cache = self._caches.pop(session, None)
        return 0 if cache is None else cache.close()

    # -- reporting -----------------------------------------------------------------

    @property
    def kv_bytes_in_use(self) -> int:
        return self.budget.in_use

    @property
    def sessions(self) -> int:
        return len(self._caches)

    def describe(self) -> dict[str, Any]:
        w = self.weights
        return {
            "model": self.name,
            "model_path": self.path,
            "model_type": self.config.model_type,
            "layers": [w.layers.start, w.layers.stop],
            "num_hidden_layers": self.config.num_hidden_layers,
            "first": self.first,
            "last": self.last,
            "weights_dtype": w.dtype,
            "weights_bytes": w.nbytes,
            "tied_head": w.tied_head,
            "rope_scaling": self.config.rope_scaling.rope_type,
            "input": "int32 token ids [batch, tokens]" if self.first
            else f"float hidden [batch, tokens, {self.config.hidden_size}]",
            "output": f"float32 logits [batch, {self.config.vocab_size}] (last position)"
            if self.last else f"float32 hidden [batch, tokens, {self.config.hidden_size}]",
            "kv_bytes_in_use": self.budget.in_use,
            "kv_budget_bytes": self.budget.limit,
            "kv_sessions": self.sessions,
            **self.model.describe(),  # engine, device, compute and weights dtype
        }  # fmt: skip

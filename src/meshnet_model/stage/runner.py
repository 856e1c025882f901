"""One stage's model with the KV caches of its sessions: what a node runs.

``StageRunner.run(session, position, inputs)`` checks a chunk against the
stage's contract, finds (or makes) the session's cache and runs the layers.
It is synchronous and safe to call from worker threads for different
sessions at once; the caller guarantees that one session's chunks come one
at a time, in order (the node's sequencer does).

Position handling — the cache must agree with the session's position (wire-2
§3: the node's count of tokens taken in):

* cache longer than the position: a chunk whose compute finished but whose
  run was then reported failed or cancelled left positions behind; they are
  dropped and the chunk recomputed (the retransmission's numbers are then
  exactly the first attempt's).
* cache shorter: context this stage never saw — refused (``CacheMismatch``).

Between chunks the caller may also ``rewind`` a session: keep its first
``length`` positions (speculative decoding's rejected drafts, issue 38;
``stage.life`` says what goes and why a rewind never reaches into an
attached prefix). Never while a step computes the session (``SessionBusy``).

A session's cache is tied to its life (issue 13): the node ``admit``s a
session when its sequencer hands a chunk to the stage and gets a
``SessionLife``; ``end_session`` (DELETE, TTL, eviction) marks that life
ended under the same lock that creates caches. So a chunk that was queued
for the compute thread when its session ended finds the life ended and
creates nothing; one that was computing stops at the next layer; and a
chunk of an ended session never hands its output on. Without this, a chunk
that ran after its session was forgotten created a cache nothing tracked —
the permanent leak of issue 13.

Costs are checked before anything is allocated (``check_head``, from the
header's shape alone): tokens per chunk (``max_chunk_tokens``), the scratch
of the forward pass (``max_compute_bytes``, see ``costs``), and positions
past ``max_position_embeddings``; the KV growth is checked by the budget
before the cache grows, and the cache grows before the embedding is built.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    CacheMismatch,
    ChunkTooLarge,
    ComputeDeadlineExceeded,
    ContextExceeded,
    PrefixUnknown,
    RewindRefused,
    SessionBusy,
    SessionEnded,
    StageInputError,
)
from ..formats.config import ModelConfig
from ..source import model_name
from . import contract
from .batch import BatchEntry
from .kv_cache import KVBudget, KVCache
from .life import SessionLife, StageWork
from .prefix_store import BlockNaming, PrefixStore
from .weights import StageWeights

if TYPE_CHECKING:  # typing only: the engines import this module
    from ..engines.base import Engine

__all__ = [
    "CacheMismatch",
    "ChunkTooLarge",
    "ComputeDeadlineExceeded",
    "ContextExceeded",
    "RewindRefused",
    "SessionBusy",
    "SessionLife",
    "StageInputError",
    "StageRunner",
    "StageWork",
]

DEFAULT_KV_BUDGET = 1024 * 1024 * 1024
# Rows (batch x tokens) of one chunk: the gateway sends 128 by default; a
# longer prompt is several chunks. meshnet-node --max-chunk-tokens.
DEFAULT_MAX_CHUNK_TOKENS = 2048
# Scratch of one chunk's forward pass (costs.chunk_cost): far above what a
# 2048-row chunk of an 8B Llama needs (~0.7 GiB), far below what a header
# could ask for. meshnet-node --max-compute-bytes.
DEFAULT_MAX_COMPUTE_BYTES = 1024 * 1024 * 1024


class StageRunner:
    def __init__(
        self,
        weights: StageWeights,
        *,
        kv_budget_bytes: int = DEFAULT_KV_BUDGET,
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        max_compute_bytes: int = DEFAULT_MAX_COMPUTE_BYTES,
        name: str | None = None,
        path: str | None = None,
        model: Engine[Any] | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        """``prefix_cache_bytes``: what ended sessions' caches may keep held for
        the prefix cache (None: half the KV budget; 0: keep none)."""
        self.weights = weights
        # The engine: numpy's StageModel unless another is given (the torch one).
        # Imported here: the engines build on this package, not it on them.
        if model is None:
            from ..engines.numpy.model import StageModel

            model = StageModel(weights)
        self.model: Engine[Any] = model
        self.config: ModelConfig = weights.config
        self.budget = KVBudget(kv_budget_bytes)
        retain = kv_budget_bytes // 2 if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix = PrefixStore(self.budget, retain)
        self.max_chunk_tokens = max_chunk_tokens
        self.max_compute_bytes = max_compute_bytes
        self.name = name
        self.path = path
        self._lives: dict[str, SessionLife] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        directory: str | Path,
        layers: range | None = None,
        *,
        dtype: str = "float32",
        kv_budget_bytes: int = DEFAULT_KV_BUDGET,
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        max_compute_bytes: int = DEFAULT_MAX_COMPUTE_BYTES,
    ) -> StageRunner:
        path = Path(directory)
        weights = StageWeights.load(path, layers, dtype=dtype)
        return cls(
            weights,
            kv_budget_bytes=kv_budget_bytes,
            max_chunk_tokens=max_chunk_tokens,
            max_compute_bytes=max_compute_bytes,
            name=model_name(path),
            path=str(path),
        )

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
        contract.check_shape(self.weights, shape, dtype)

    def check_head(self, shape: tuple[int, ...], dtype: str, position: int | None = None) -> None:
        """``check_shape`` and the chunk's cost, from its header alone.

        Refuses (``ChunkTooLarge``, ``ContextExceeded``) what would allocate
        or compute more than the limits allow, before a byte of the body is
        read. The scores are costed over the chunk's own context when its
        ``position`` is known (the header's, or at run time), else over the
        longest context a session can reach (``reachable_context``).
        """
        contract.check_shape(self.weights, shape, dtype)
        contract.check_cost(
            self.weights,
            self.model,
            shape,
            position,
            kv_budget=self.budget.limit,
            max_chunk_tokens=self.max_chunk_tokens,
            max_compute_bytes=self.max_compute_bytes,
        )

    def check_position(self, position: int, tokens: int) -> None:
        """Refuse positions past the model's context (RoPE was never trained there)."""
        contract.check_position(self.config, position, tokens)

    def check_input(self, inputs: np.ndarray, position: int | None = None) -> None:
        """Raise ``StageInputError`` unless ``inputs`` is what this stage takes."""
        self.check_head(inputs.shape, inputs.dtype.name, position)
        contract.check_values(self.weights, inputs)

    def output_shape(self, inputs_shape: tuple[int, ...]) -> tuple[int, ...]:
        batch, tokens = inputs_shape[0], inputs_shape[1]
        if self.last:
            return (batch, self.config.vocab_size)
        return (batch, tokens, self.config.hidden_size)

    # -- running -------------------------------------------------------------------

    def admit(self, session: str) -> SessionLife:
        """The session's current life (a new one if it has none).

        The node calls this in the same event-loop step as its sequencer
        hands the chunk to the stage, so the session is known to the table
        then, and any later forget reaches this life.
        """
        with self._lock:
            life = self._lives.get(session)
            if life is None:
                life = self._lives[session] = SessionLife(session)
            return life

    def prepare_prefix(
        self,
        life: SessionLife,
        position: int,
        inputs: np.ndarray,
        prefix: str | None,
        blocks: Sequence[str],
        naming: BlockNaming,
    ) -> None:
        """Before a chunk runs (wire-2 §3.10): note the prefix a new session
        starts from, and the block keys to file once the chunk has run. The
        first stage checks the keys against the token ids (``PrefixMismatch``),
        named by ``naming`` (the caller's: the wire's hash chain)."""
        life.prepare_prefix(position, inputs, prefix, blocks, naming, first=self.first)

    def run(
        self,
        session: str,
        position: int,
        inputs: np.ndarray,
        *,
        life: SessionLife | None = None,
        deadline: float | None = None,
    ) -> np.ndarray:
        """Run a chunk. ``life``: from ``admit`` (default: admitted now);
        ``deadline``: a ``time.monotonic()`` after which the compute stops
        between layers (``ComputeDeadlineExceeded``)."""
        work = StageWork(life or self.admit(session), position, inputs, deadline)
        self.run_batch([work])
        return work.result()

    def run_batch(self, works: Sequence[StageWork]) -> None:
        """Run several sessions' chunks as one step (``stage.batch``): each
        work ends with its ``output`` or its ``error``, as ``run`` would have
        returned or raised it alone. One work per session in a step (the
        node's sequencer hands a session's chunks out one at a time)."""
        entries = []
        try:
            for work in works:
                try:
                    entries.append(self._entry(work))
                except Exception as exc:  # the chunk's own fault: it alone fails
                    work.error = exc
            self.model.forward_batch([entry for _, entry in entries])  # each entry: its outcome
            for work, entry in entries:
                if entry.error is not None:
                    work.error = entry.error
                elif work.life.ended:  # ended while computing: its output must not travel on
                    work.error = SessionEnded(
                        f"session {work.life.session} ended while its chunk was computing"
                    )
                else:
                    work.output = entry.output
                    work.life.file_ready(self.prefix)
        finally:  # after the filing: a rewind never meets a chunk half accounted
            with self._lock:
                for work in works:
                    if work.life.busy is work:
                        work.life.busy = None

    def _entry(self, work: StageWork) -> tuple[StageWork, BatchEntry[Any]]:
        """Check one chunk and bring its session's cache to its position."""
        life, position, inputs = work.life, work.position, work.inputs
        self.check_input(inputs, position)
        self.check_position(position, inputs.shape[1])
        cache = self._cache_for(work)
        if cache.batch != inputs.shape[0]:
            raise StageInputError(
                f"session {life.session} started with batch {cache.batch}, this chunk has "
                f"{inputs.shape[0]}"
            )
        if life.attach is not None and cache.length == 0 and position > 0:
            self._attach(life, cache, position)
        if cache.length > position:
            self.prefix.unfile_after(cache, position)
            cache.truncate(position)
        elif cache.length < position:
            raise CacheMismatch(
                f"session {life.session}: this stage's KV cache holds {cache.length} "
                f"positions, the chunk starts at {position}"
            )
        stop = _stopper(life, work.deadline)
        return work, BatchEntry(inputs, cache, position, stop, logit_rows=work.logit_rows)

    def _attach(self, life: SessionLife, cache: KVCache, position: int) -> None:
        """A prefix-cache hit: the session's first ``position`` positions are a
        copy of the cached prefix's (the numbers a cold run computed)."""
        assert life.attach is not None
        found = self.prefix.find(life.attach)
        if found is None or found[1] != position:
            raise PrefixUnknown(
                f"session {life.session}: this stage holds no cached prefix "
                f"{life.attach} of {position} positions (evicted, or never computed here)"
            )
        cache.copy_prefix(found[0], position)
        life.attach, life.floor = None, position
        with self.budget.lock:
            self.prefix.tokens_saved += position

    def _cache_for(self, work: StageWork) -> KVCache:
        """The session's cache (made now if it has none); the session is busy
        from here to the step's end (``run_batch``)."""
        life = work.life
        with self._lock:
            if life.ended:  # forgotten while the chunk waited: create nothing
                raise SessionEnded(f"session {life.session} ended before its chunk ran")
            if life.cache is None:
                life.cache = self.model.new_cache(self.budget, work.inputs.shape[0])
            life.busy = work
            return life.cache

    def rewind(self, session: str, length: int, life: SessionLife | None = None) -> int:
        """Keep the session's positions ``[0, length)`` and drop the rest: the
        drafted positions past a verify window's accepted prefix (issue 38;
        ``stage.life``; ``life``: a rewind chunk's, ``SessionLife.rewind_chunk``).
        Returns how many went (0: a no-op, or a session this stage does not
        hold and ``length`` 0).

        ``RewindRefused`` (a ValueError) for a length outside ``[floor,
        held]``; ``SessionBusy`` while a step computes the session (the
        caller rewinds between its chunks, as its sequencer orders them).
        """
        with self._lock:
            if life is not None:
                return life.rewind_chunk(length, self.prefix)
            life = self._lives.get(session)
            if life is None:
                return SessionLife(session).rewind(length, self.prefix)  # refuses all but 0
            if life.busy is not None:
                raise SessionBusy(f"session {session}: a chunk of it is computing")
            return life.rewind(length, self.prefix)

    def end_session(self, session: str) -> int:
        """End the session's life and free its cache; returns the bytes given back."""
        with self._lock:
            life = self._lives.pop(session, None)
            if life is None:
                return 0
            life.ended = True
            cache, life.cache = life.cache, None
        if cache is None or self.prefix.retain(cache):
            return 0  # a retained cache keeps its bytes for the prefix cache
        self.prefix.forget(cache)
        return cache.close()

    # -- the KV hand-off (wire-2 §3.11, stage/handoff.py) ---------------------------

    def cache_of(self, session: str) -> KVCache | None:
        with self._lock:
            life = self._lives.get(session)
            return None if life is None else life.cache

    def give_cache(self, session: str, cache: KVCache) -> None:
        """``session`` (new here) goes on from ``cache`` (a KV import's)."""
        with self._lock:
            if (life := self._lives.get(session)) and (life.cache or life.ended):
                raise ValueError(f"session {session} already holds a cache here")
            self._lives[session] = SessionLife(session, cache=cache, imported=True)

    # -- reporting -----------------------------------------------------------------

    @property
    def kv_bytes_in_use(self) -> int:
        return self.budget.in_use

    @property
    def sessions(self) -> int:
        """Sessions holding a cache."""
        with self._lock:
            return sum(1 for life in self._lives.values() if life.cache is not None)

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
            "input": "int32 token ids [batch, tokens]"
            if self.first
            else f"float hidden [batch, tokens, {self.config.hidden_size}]",
            "output": f"float32 logits [batch, {self.config.vocab_size}] (last position)"
            if self.last
            else f"float32 hidden [batch, tokens, {self.config.hidden_size}]",
            "kv_bytes_in_use": self.budget.in_use,
            # what live sessions hold: the rest is the prefix cache's (retained)
            "kv_live_bytes": self.budget.in_use - self.prefix.retained_bytes,
            "kv_budget_bytes": self.budget.limit,
            "kv_sessions": self.sessions,
            "prefix_cache": self.prefix.describe(),
            **self.model.describe(),  # engine, device, compute and weights dtype
        }


def _stopper(life: SessionLife, deadline: float | None) -> Callable[[], None]:
    """What ``forward`` calls before each layer: stop if the session ended or
    the deadline passed, so a node is free again within one layer's time."""

    def check() -> None:
        if life.ended:
            raise SessionEnded(f"session {life.session} ended while its chunk was computing")
        if deadline is not None and time.monotonic() >= deadline:
            raise ComputeDeadlineExceeded("the request's deadline passed during the compute")

    return check

"""Stage backends: what a node computes on each chunk.

A stage is what ``NodeApp`` awaits on every chunk it admits: see
``StageBackend``. It gets the chunk's tensor and a ``StageContext`` (the
session, where the chunk starts in it, its index in the run), and is told
when a session ends, so a stage with per-session state (a model's KV cache,
``meshnet_node.model_stage``) can keep and free it. The stubs here (``echo``,
``zeros``, and ``count``: echo that counts its runs per chunk, for fault and
load tests) are plain functions of the tensor, wrapped in ``Stage``.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np
from prometheus_client import CollectorRegistry

if TYPE_CHECKING:  # typing only: the hand-off module builds on the core, not on stages
    from .handoff import KVStore

__all__ = [
    "BACKENDS",
    "ChunkKey",
    "CountingStage",
    "Stage",
    "StageBackend",
    "StageContext",
    "echo",
    "make_stage",
    "stub_identity",
    "zeros",
]

StageFn = Callable[[np.ndarray], np.ndarray | Awaitable[np.ndarray]]


def echo(tensor: np.ndarray) -> np.ndarray:
    """The chunk unchanged (zero-copy: the received buffer itself)."""
    return tensor


def zeros(tensor: np.ndarray) -> np.ndarray:
    """A zeroed tensor of the same shape and dtype."""
    return np.zeros_like(tensor)


BACKENDS: dict[str, StageFn] = {"echo": echo, "zeros": zeros, "count": echo}

# (session, chunk index, position): which chunk a stage run is for.
ChunkKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class StageContext:
    """Where a chunk sits: from the node's sequencer ticket (wire-2 §3).

    ``position`` is the session's count of tokens taken in before this chunk
    (the node's own, also when the sender sent no ``X-Meshnet-Position``);
    ``tokens`` the chunk's length along the token axis; ``run`` counts the
    session's runs (a prefill, then one per decode step). ``deadline`` is the
    request's deadline on the ``time.monotonic()`` clock (usable from a
    worker thread, unlike the event loop's clock), or None.
    """

    session: str
    position: int
    tokens: int
    index: int
    total: int
    run: int = 0
    deadline: float | None = None
    # wire-2 §3.10: the cached prefix a new session starts from, and the keys
    # of the blocks ending in this chunk (the model stage files its KV under them).
    prefix: str | None = None
    prefix_blocks: tuple[str, ...] = ()
    # wire-2 §3.15: the salt the session's block keys start from (its tenant's).
    cache_salt: str | None = None
    # wire-2 §3.16: the last positions a last stage makes logits of (a verify
    # window's k + 1), and, for a rewind, the position F the session held:
    # the stage drops [position, F) before it runs the chunk (a stage with no
    # KV, a stub, has nothing to drop).
    logit_rows: int = 1
    rewind_from: int | None = None


_CONTEXT_FIELDS = (
    "session",
    "position",
    "tokens",
    "index",
    "total",
    "run",
    "deadline",
    "prefix",
    "prefix_blocks",
    "cache_salt",
    "logit_rows",
    "rewind_from",
)
(
    _set_session,
    _set_position,
    _set_tokens,
    _set_index,
    _set_total,
    _set_run,
    _set_deadline,
    _set_prefix,
    _set_prefix_blocks,
    _set_cache_salt,
    _set_logit_rows,
    _set_rewind_from,
) = (StageContext.__dict__[name].__set__ for name in _CONTEXT_FIELDS)


def stage_context(
    session: str,
    position: int,
    tokens: int,
    index: int,
    total: int,
    run: int,
    deadline: float | None,
    prefix: str | None,
    prefix_blocks: tuple[str, ...],
    cache_salt: str | None = None,
    logit_rows: int = 1,
    rewind_from: int | None = None,
) -> StageContext:
    """The `StageContext` of these values (a ticket's and its checked
    headers'), equal to constructing it: its slots set directly, past the
    frozen class's keyword ``__init__`` (1.3 -> 0.5 us a chunk: section decode)."""
    context = object.__new__(StageContext)
    _set_session(context, session)
    _set_position(context, position)
    _set_tokens(context, tokens)
    _set_index(context, index)
    _set_total(context, total)
    _set_run(context, run)
    _set_deadline(context, deadline)
    _set_prefix(context, prefix)
    _set_prefix_blocks(context, prefix_blocks)
    _set_cache_salt(context, cache_salt)
    _set_logit_rows(context, logit_rows)
    _set_rewind_from(context, rewind_from)
    return context


class StageBackend(Protocol):
    """What ``NodeApp`` needs of a stage.

    ``__call__`` runs the chunk (never twice for one admitted chunk: replays
    and reforwards reuse its output); chunks of one session come one at a
    time, in order. ``end_session`` is called when the node forgets a
    session — DELETE, TTL expiry, expiry to make room — also while one of its
    chunks is still computing. A stage raising ``MeshnetError`` has it
    answered as is (a 4xx for a chunk it cannot take, 503 when full); any
    other exception is a 500. ``check_head(shape, dtype, position)`` raises
    ``MeshnetError`` to refuse a chunk from its headers alone, before the
    body is read (``position``: the header's ``x-meshnet-position``, or None
    when the chunk has none); ``bind_metrics(registry)`` adds the stage's own
    gauges (a model's KV cache) to the node's ``/metrics``. Every stage has
    all of it (the node never asks which parts a stage has): ``Stage`` and
    ``ModelStage`` implement it, ``Stage``'s ``check_head`` and
    ``bind_metrics`` doing nothing.
    """

    name: str
    calls: int

    async def __call__(
        self, tensor: np.ndarray, context: StageContext | None = None
    ) -> np.ndarray: ...

    def end_session(self, session: str) -> None: ...

    def check_head(
        self, shape: tuple[int, ...], dtype: str, position: int | None = None
    ) -> None: ...

    def bind_metrics(self, registry: CollectorRegistry) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def kv_store(self) -> KVStore | None:
        """Its sessions' KV for a hand-off (wire-2 §3.11); None: it keeps none."""
        ...

    def identity(self) -> dict[str, Any]:
        """What this stage serves (wire-2 §6.1): ``model``, ``weights``,
        ``tokenizer``, ``layers`` ([start, stop] or None), ``n_layers``,
        ``vocab``, ``hidden``, ``max_context``, ``engine``, ``dtype``,
        ``input`` and ``output``. Fixed once the stage is loaded."""
        ...


def stub_identity(name: str) -> dict[str, Any]:
    """The identity of a stub stage: no model, no layers, any tensor in and out."""
    return {
        "model": f"stub-{name}",
        "weights": None,
        "tokenizer": None,
        "layers": None,
        "n_layers": None,
        "vocab": None,
        "hidden": None,
        "max_context": None,
        "engine": None,
        "dtype": None,
        "input": "any",
        "output": "any",
    }


@dataclass(slots=True)
class Stage:
    """One stage: ``fn`` plus a simulated compute delay (``--delay-ms``).

    A sync ``fn`` runs on the event loop: only cheap stages belong there; a
    real layer should be async (or wrap itself in ``anyio.to_thread``).
    ``calls`` counts runs, which is what "a replay does not rerun the stage"
    is checked against.
    """

    name: str
    fn: StageFn
    delay_ms: float = 0.0
    calls: int = 0

    async def __call__(self, tensor: np.ndarray, context: StageContext | None = None) -> np.ndarray:
        self.calls += 1
        if self.delay_ms:
            await anyio.sleep(self.delay_ms / 1000)
        result = self.fn(tensor)
        # An ndarray first: isawaitable's ABC check was ~0.5 us of a decode step.
        if not isinstance(result, np.ndarray) and inspect.isawaitable(result):
            result = await result
        if not isinstance(result, np.ndarray):
            raise TypeError(f"stage {self.name} returned {type(result).__name__}, not an ndarray")
        return result

    def end_session(self, session: str) -> None:
        """Stateless: nothing to free."""

    def check_head(self, shape: tuple[int, ...], dtype: str, position: int | None = None) -> None:
        """Any tensor goes: the function decides nothing from headers."""

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """No gauges of its own."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "delay_ms": self.delay_ms}

    def kv_store(self) -> KVStore | None:
        """Stateless: no KV to hand off (409 kv_unsupported)."""
        return None

    def identity(self) -> dict[str, Any]:
        return stub_identity(self.name)


@dataclass(slots=True)
class CountingStage(Stage):
    """``echo`` that counts how often it ran each chunk (``--backend count``).

    The proof behind "no stage runs a chunk twice" under retries and replays:
    ``runs[(session, index, position)]`` must never exceed 1. For tests and
    diagnostics only: it keeps one counter entry per chunk ever run.
    """

    runs: Counter[ChunkKey | None] = field(default_factory=Counter)

    async def __call__(self, tensor: np.ndarray, context: StageContext | None = None) -> np.ndarray:
        key = None if context is None else (context.session, context.index, context.position)
        self.runs[key] += 1
        return await Stage.__call__(self, tensor, context)

    def describe(self) -> dict[str, Any]:
        # Bounded summary (not the table itself) for /info.
        return {
            **Stage.describe(self),
            "runs": sum(self.runs.values()),
            "chunks": len(self.runs),
            "max_runs_per_chunk": max(self.runs.values(), default=0),
        }


def make_stage(name: str, delay_ms: float = 0.0) -> Stage:
    if name == "count":
        return CountingStage(name, echo, delay_ms)
    try:
        return Stage(name, BACKENDS[name], delay_ms)
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})") from None

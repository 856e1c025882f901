"""A node stage that runs a contiguous range of a Llama model's layers.

``meshnet-node --model DIR --layers A:B [--dtype ...] [--kv-budget-bytes N]``
builds one of these. The contract every node of a chain keeps (docs/models.md):

* the stage owning layer 0 takes token ids, int32 ``[batch, tokens]``;
* a middle stage maps hidden ``[batch, tokens, hidden]`` to hidden (sent in the
  node's ``--wire-dtype``: ``keep`` sends the float32 it computes, exactly);
* the stage owning the last layer returns the float32 logits of the chunk's
  last position, ``[batch, vocab]`` (a verify window's last ``k + 1``,
  ``[1, k + 1, vocab]``: wire-2 §3.16); one node with every layer maps ids
  to logits.

Each session has a KV cache that grows chunk by chunk at the positions the
node's sequencer hands out, so a run after a finished run continues the
context (a decode step is a run of one ``[1, 1]`` chunk). The cache goes when
the node forgets the session (``end_session``). The compute runs in a
worker thread so the event loop keeps serving, one batched step at a time
(``scheduler``: the ready chunks of different sessions together), since BLAS
and torch already spread a product over the stage's threads and two steps at
once would only fight for them.

A session's cache lives exactly as long as the session on this node: the
stage ``admit``s the session when the sequencer hands it a chunk, and a
forget (DELETE, TTL, eviction) in any phase — queued for the compute
thread, computing, waiting downstream — ends that life at once, so no cache
is left behind (``StageRunner``). The compute checks, between layers, that
the session is alive and that the request's deadline has not passed.

Errors: a chunk the stage cannot take is 400 ``bad_stage_input``; more
positions than the model's context 400 ``context_length_exceeded``; more rows
or scratch than ``--max-chunk-tokens``/``--max-compute-bytes`` allow 413
``chunk_too_large`` (both from the header, before the body is read); a
deadline spent during the compute 504 ``deadline_exceeded``; a KV budget
that cannot hold the chunk is 503 ``kv_memory_full`` with ``Retry-After``; a
cache that lacks the context the chunk follows is 409 ``kv_cache_mismatch``;
a session ended while its chunk computed is 409 ``session_unknown``; a
rewind into the cached prefix a session attached is 409 ``rewind_refused``
(wire-2 §3.16: the stage drops ``[position, F)`` before the chunk, between
steps, and changes nothing when it cannot).
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshnet_model import (
    BlockNaming,
    CacheMismatch,
    KVBudgetExceeded,
    SessionEnded,
    StageInputError,
    StageRunner,
)
from meshnet_model.engines.footprint import StageFootprint
from meshnet_model.errors import (
    ChunkTooLarge,
    ComputeDeadlineExceeded,
    ContextExceeded,
    PrefixMismatch,
    PrefixUnknown,
    RewindRefused,
)
from meshnet_model.identity import ModelIdentity, model_identity
from meshnet_model.stage.handoff import export_kv, import_kv, kv_layout
from meshnet_proto import CapacityError, DownstreamError, ErrorCode, ProtocolError, SequencingError
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, prefix_block_keys
from meshnet_runtime.metrics import ReadAtScrape, Sample

from .backends import StageContext
from .handoff import KVLayout, KVStore
from .scheduler import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_QUEUED_TOKENS,
    StageScheduler,
    micro_batches_for,
)

__all__ = ["KV_RETRY_AFTER", "ModelStage", "block_naming"]

# Seconds a client is told to wait when the KV budget is full: sessions free
# their caches when they end, typically within a generation's time.
KV_RETRY_AFTER = 5
# The prefix cache's block keys are the wire's (wire-2 §3.10): the model
# package is given them, it does not import the wire.
WIRE_BLOCK_NAMING = BlockNaming(PREFIX_BLOCK_TOKENS, prefix_block_keys)


def block_naming(salt: str | None) -> BlockNaming:
    """The wire's naming for a session whose keys start from ``salt``
    (wire-2 §3.15: its tenant's): fixed at the session's first chunk."""
    if salt is None:
        return WIRE_BLOCK_NAMING
    return BlockNaming(PREFIX_BLOCK_TOKENS, functools.partial(prefix_block_keys, salt=salt))


_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ModelStage:
    """``StageBackend`` over a ``StageRunner`` (see the module docstring), its
    chunks batched across sessions by a ``StageScheduler``."""

    def __init__(
        self,
        runner: StageRunner,
        *,
        footprint: StageFootprint | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
        micro_batches: int = 0,
        identity: ModelIdentity | None = None,
    ) -> None:
        """``micro_batches`` 0: the chain's stage count, from this stage's layer share.
        ``identity``: the stage's digests, computed at load (None: from the
        runner's checkpoint path when first asked)."""
        self.runner = runner
        self._identity = identity
        layers = runner.weights.layers
        self.name = f"model[{layers.start}:{layers.stop}]"
        self.calls = 0
        self.footprint = footprint  # what it holds, known before loading
        groups = micro_batches or micro_batches_for(layers, runner.config.num_hidden_layers)
        self.scheduler = StageScheduler(
            runner,
            max_batch_tokens=max_batch_tokens,
            max_queued_tokens=max_queued_tokens,
            micro_batches=groups,
        )

    @property
    def compute_seconds(self) -> float:
        """Wall time inside the layers (batched steps), for benchmarks."""
        return self.scheduler.busy_seconds

    async def __call__(self, tensor: np.ndarray, context: StageContext | None = None) -> np.ndarray:
        if context is None:
            raise ValueError("a model stage needs the chunk's session context")
        self.calls += 1
        # Before any await: the sequencer handed us this chunk in this very
        # event-loop step, so the session is known and a later forget ends
        # exactly this life (see StageRunner.admit).
        life = self.runner.admit(context.session)
        try:
            if context.rewind_from is not None:  # wire-2 §3.16: before anything else changes
                await self.scheduler.rewind(life, context.position)
            naming = block_naming(context.cache_salt)
            self.runner.prepare_prefix(
                life, context.position, tensor, context.prefix, context.prefix_blocks, naming
            )
            # The value checks (ids in the vocabulary, finite hidden states)
            # are O(tensor): in the worker thread with the compute.
            output = await self.scheduler.run(
                life, context.position, tensor, context.deadline, context.logit_rows
            )
        except StageInputError as exc:
            raise _input_error(exc) from None
        except ComputeDeadlineExceeded as exc:
            raise DownstreamError(
                f"{exc}; stopped between layers",
                code=ErrorCode.DEADLINE_EXCEEDED,
                header="x-meshnet-deadline-ms",
            ) from None
        except KVBudgetExceeded as exc:
            raise CapacityError(
                f"KV cache memory is full: {exc}",
                code=ErrorCode.KV_MEMORY_FULL,
                retry_after=KV_RETRY_AFTER,
            ) from None
        except PrefixUnknown as exc:
            raise SequencingError(
                str(exc), code=ErrorCode.PREFIX_UNKNOWN, header="x-meshnet-prefix"
            ) from None
        except RewindRefused as exc:
            raise SequencingError(
                str(exc), code=ErrorCode.REWIND_REFUSED, header="x-meshnet-after"
            ) from None
        except CacheMismatch as exc:
            raise SequencingError(
                str(exc), code=ErrorCode.KV_CACHE_MISMATCH, header="x-meshnet-position"
            ) from None
        except SessionEnded:
            raise SequencingError(
                f"session {context.session} ended while its chunk was computing",
                code=ErrorCode.SESSION_UNKNOWN,
                header="x-meshnet-session",
            ) from None
        return output

    def check_head(self, shape: tuple[int, ...], dtype: str, position: int | None = None) -> None:
        """Refuse a chunk of the wrong dtype or shape, or one that costs more
        than the limits allow, before its body is read (``position``: the
        header's, when it has one)."""
        try:
            self.runner.check_head(shape, dtype, position)
        except StageInputError as exc:
            raise _input_error(exc) from None

    def end_session(self, session: str) -> None:
        self.runner.end_session(session)

    # -- the KV hand-off (wire-2 §3.11): ``KVStore`` ------------------------------

    def kv_store(self) -> KVStore:
        return self

    @property
    def kv_layout(self) -> KVLayout:
        layers, heads, head_dim, dtype, per_position = kv_layout(self.runner)
        return KVLayout(
            layers,
            heads,
            head_dim,
            dtype,
            per_position,
            max_context=self.runner.config.max_position_embeddings,
            max_batch=self.runner.max_chunk_tokens,
        )

    def kv_free_bytes(self) -> int:
        budget = self.runner.budget
        return budget.limit - budget.in_use + self.runner.prefix.retained_bytes

    def hold_kv(self, nbytes: int) -> None:
        try:
            self.runner.budget.hold(nbytes)
        except KVBudgetExceeded as exc:
            raise CapacityError(
                f"KV cache memory is full: {exc}",
                code=ErrorCode.KV_MEMORY_FULL,
                retry_after=KV_RETRY_AFTER,
            ) from None

    def release_kv(self, nbytes: int) -> None:
        self.runner.budget.release(nbytes)

    async def export_kv(self, session: str) -> np.ndarray | None:
        # A copy of up to the whole budget: off the event loop.
        return await anyio.to_thread.run_sync(export_kv, self.runner, session)

    async def import_kv(self, session: str, state: np.ndarray, held: int) -> None:
        try:
            await anyio.to_thread.run_sync(
                functools.partial(import_kv, self.runner, session, state, held=held)
            )
        except KVBudgetExceeded as exc:
            raise CapacityError(
                f"KV cache memory is full: {exc}",
                code=ErrorCode.KV_MEMORY_FULL,
                retry_after=KV_RETRY_AFTER,
            ) from None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """The KV cache's gauges and the scheduler's on ``/metrics``: busy
        seconds (utilisation = its rate), steps, rows and chunks per step, and
        the rows waiting for compute."""
        used = Gauge(
            "meshnet_kv_cache_bytes", "KV cache bytes allocated, all sessions", registry=registry
        )
        used.set_function(lambda: self.runner.kv_bytes_in_use)
        limit = Gauge(
            "meshnet_kv_budget_bytes", "KV cache budget (--kv-budget-bytes)", registry=registry
        )
        limit.set(self.runner.budget.limit)
        busy = Counter(
            "meshnet_stage_busy_seconds",
            "Seconds the stage computed (its utilisation is this counter's rate)",
            registry=registry,
        )
        steps = Counter("meshnet_stage_steps", "Batched steps the stage ran", registry=registry)
        rows = Histogram(
            "meshnet_stage_step_rows",
            "Token rows per batched step",
            buckets=_ROW_BUCKETS,
            registry=registry,
        )
        chunks = Histogram(
            "meshnet_stage_step_chunks",
            "Sessions' chunks per batched step",
            buckets=_CHUNK_BUCKETS,
            registry=registry,
        )
        queued = Gauge(
            "meshnet_stage_queued_rows",
            "Token rows waiting for the stage's compute",
            registry=registry,
        )
        queued.set_function(lambda: self.scheduler.queued_rows)

        def on_step(step_chunks: int, step_rows: int, seconds: float) -> None:
            busy.inc(seconds)
            steps.inc()
            rows.observe(step_rows)
            chunks.observe(step_chunks)

        self.scheduler.on_step = on_step
        registry.register(ReadAtScrape(lambda: _prefix_samples(self.runner)))

    @property
    def kv_bytes_in_use(self) -> int:
        return self.runner.kv_bytes_in_use

    def identity(self) -> dict[str, Any]:
        """The model fields of the node's ``/info`` identity (wire-2 §6.1): the
        checkpoint's, the held tensors' and the tokenizer's digests
        (``meshnet_model.identity``) and the stage's shape and place."""
        if self._identity is None:
            if self.runner.path is None:
                raise ValueError(f"{self.name}: no checkpoint path to compute its identity from")
            self._identity = model_identity(
                self.runner.path, self.runner.weights.layers, config=self.runner.config
            )
        ident, c = self._identity, self.runner.config
        return {
            "model": ident.model,
            "weights": ident.weights,
            "tokenizer": ident.tokenizer,
            "layers": list(ident.layers),
            "n_layers": c.num_hidden_layers,
            "vocab": c.vocab_size,
            "hidden": c.hidden_size,
            "max_context": c.max_position_embeddings,
            "engine": self._engine,
            "dtype": self.runner.weights.dtype,
            "input": "tokens" if self.runner.first else "hidden",
            "output": "logits" if self.runner.last else "hidden",
        }

    @property
    def _engine(self) -> str:
        return str(self.runner.model.describe()["engine"])

    def describe(self) -> dict[str, Any]:
        footprint = {"footprint": self.footprint.to_dict()} if self.footprint else {}
        cores = {"cores": self.scheduler.cores.describe()} if self.scheduler.cores else {}
        return {"backend": "model", **self.runner.describe(), **footprint, **cores}


def _prefix_samples(runner: StageRunner) -> list[Sample]:
    """The prefix cache's counts (wire-2 §3.10), for ``/metrics``."""
    store = runner.prefix
    return [
        (
            "counter",
            "meshnet_prefix_cache_hits",
            "New sessions that started from a cached prefix",
            store.hits,
        ),
        (
            "counter",
            "meshnet_prefix_cache_misses",
            "New sessions that named a prefix this stage did not hold",
            store.misses,
        ),
        (
            "counter",
            "meshnet_prefix_cache_tokens_saved",
            "Positions taken from the prefix cache instead of computed",
            store.tokens_saved,
        ),
        (
            "gauge",
            "meshnet_prefix_cache_bytes",
            "KV bytes held by ended sessions' retained prefixes",
            store.retained_bytes,
        ),
        ("gauge", "meshnet_prefix_cache_entries", "Retained prefix caches", store.retained),
    ]


def _input_error(exc: StageInputError) -> ProtocolError:
    if isinstance(exc, PrefixMismatch):
        return ProtocolError(str(exc), code=ErrorCode.BAD_PREFIX, header="x-meshnet-prefix-blocks")
    if isinstance(exc, ChunkTooLarge):
        return ProtocolError(str(exc), code=ErrorCode.CHUNK_TOO_LARGE, header="x-meshnet-shape")
    if isinstance(exc, ContextExceeded):
        return ProtocolError(str(exc), code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    return ProtocolError(str(exc), code=ErrorCode.BAD_STAGE_INPUT)

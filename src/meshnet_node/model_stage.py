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

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
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
    StageWeights,
    parse_layers,
)
from meshnet_model.engines.choice import choose_engine, set_blas_threads
from meshnet_model.engines.core_ledger import ledger_for
from meshnet_model.engines.fit import fit_process
from meshnet_model.engines.footprint import StageFootprint
from meshnet_model.errors import (
    ChunkTooLarge,
    ComputeDeadlineExceeded,
    ContextExceeded,
    PrefixMismatch,
    PrefixUnknown,
    RewindRefused,
)
from meshnet_model.formats.config import ModelConfig
from meshnet_model.identity import ModelIdentity, load_plan

# Re-exported by name: meshnet_bench.identity swaps it here to time a load without it.
from meshnet_model.identity import model_identity as model_identity
from meshnet_model.progress import NO_PROGRESS, LoadProgress, reporting
from meshnet_model.source import load_config, model_name
from meshnet_model.stage.handoff import export_kv, import_kv, kv_layout
from meshnet_model.stage.runner import (
    DEFAULT_MAX_CHUNK_TOKENS,
    DEFAULT_MAX_COMPUTE_BYTES,
)
from meshnet_proto import CapacityError, DownstreamError, ErrorCode, ProtocolError, SequencingError
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, prefix_block_keys
from meshnet_runtime.memory import MemoryLimit, limit_from_flag
from meshnet_runtime.metrics import ReadAtScrape, Sample

from .backends import StageContext
from .config import NodeConfig
from .handoff import KVLayout, KVStore
from .scheduler import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_QUEUED_TOKENS,
    StageScheduler,
    micro_batches_for,
)

__all__ = ["KV_RETRY_AFTER", "ModelStage", "load_model_stage", "stage_from_config"]

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

    def __init__(self, runner: StageRunner, *, footprint: StageFootprint | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
                 micro_batches: int = 0,
                 identity: ModelIdentity | None = None) -> None:  # fmt: skip
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
        self.scheduler = StageScheduler(runner, max_batch_tokens=max_batch_tokens,
                                        max_queued_tokens=max_queued_tokens,
                                        micro_batches=groups)  # fmt: skip

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
        return KVLayout(layers, heads, head_dim, dtype, per_position,
                        max_context=self.runner.config.max_position_embeddings,
                        max_batch=self.runner.max_chunk_tokens)  # fmt: skip

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
        used = Gauge("meshnet_kv_cache_bytes", "KV cache bytes allocated, all sessions",
                     registry=registry)  # fmt: skip
        used.set_function(lambda: self.runner.kv_bytes_in_use)
        limit = Gauge("meshnet_kv_budget_bytes", "KV cache budget (--kv-budget-bytes)",
                      registry=registry)  # fmt: skip
        limit.set(self.runner.budget.limit)
        busy = Counter("meshnet_stage_busy_seconds",
                       "Seconds the stage computed (its utilisation is this counter's rate)",
                       registry=registry)  # fmt: skip
        steps = Counter("meshnet_stage_steps", "Batched steps the stage ran", registry=registry)
        rows = Histogram("meshnet_stage_step_rows", "Token rows per batched step",
                         buckets=_ROW_BUCKETS, registry=registry)  # fmt: skip
        chunks = Histogram("meshnet_stage_step_chunks", "Sessions' chunks per batched step",
                           buckets=_CHUNK_BUCKETS, registry=registry)  # fmt: skip
        queued = Gauge("meshnet_stage_queued_rows", "Token rows waiting for the stage's compute",
                       registry=registry)  # fmt: skip
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
            self._identity = model_identity(self.runner.path, self.runner.weights.layers,
                                            config=self.runner.config)  # fmt: skip
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
        ("counter", "meshnet_prefix_cache_hits", "New sessions that started from a cached prefix",
         store.hits),
        ("counter", "meshnet_prefix_cache_misses",
         "New sessions that named a prefix this stage did not hold", store.misses),
        ("counter", "meshnet_prefix_cache_tokens_saved",
         "Positions taken from the prefix cache instead of computed", store.tokens_saved),
        ("gauge", "meshnet_prefix_cache_bytes",
         "KV bytes held by ended sessions' retained prefixes", store.retained_bytes),
        ("gauge", "meshnet_prefix_cache_entries", "Retained prefix caches", store.retained),
    ]  # fmt: skip


def _input_error(exc: StageInputError) -> ProtocolError:
    if isinstance(exc, PrefixMismatch):
        return ProtocolError(str(exc), code=ErrorCode.BAD_PREFIX, header="x-meshnet-prefix-blocks")
    if isinstance(exc, ChunkTooLarge):
        return ProtocolError(str(exc), code=ErrorCode.CHUNK_TOO_LARGE, header="x-meshnet-shape")
    if isinstance(exc, ContextExceeded):
        return ProtocolError(str(exc), code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    return ProtocolError(str(exc), code=ErrorCode.BAD_STAGE_INPUT)


def load_model_stage(
    model: str | Path,
    layers: str | None = None,
    *,
    dtype: str = "auto",
    kv_budget_bytes: int | str,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    max_compute_bytes: int = DEFAULT_MAX_COMPUTE_BYTES,
    engine: str = "auto",
    device: str = "cpu",
    threads: int | None = None,
    limit: MemoryLimit | None = None,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
    micro_batches: int = 0,
    log_level: str | None = None,
    weights_cache: str = "off",
) -> ModelStage:
    """Load the stage's tensors from a checkpoint directory (the node's flags).

    ``engine``/``dtype`` ``auto``: a GGUF file held quantized on torch when it
    is installed, else numpy float32 (``engines.choice``). ``threads``: the
    stage's compute threads (None: the library's default). ``max_batch_tokens``,
    ``max_queued_tokens``, ``micro_batches``: the scheduler's (``scheduler``).
    ``log_level``: the load's progress is reported at info and below
    (``meshnet_model.progress``; None, the default: nothing is said).
    ``weights_cache``: ``--weights-cache`` (off, auto or a directory).

    Raises ``ValueError`` (``ConfigError``, ``CheckpointError`` among them)
    with a message fit for the command line.
    """
    config = load_config(model)  # a checkpoint directory or a .gguf file
    span = parse_layers(layers, config.num_hidden_layers) if layers else None
    engine, dtype = choose_engine(model, engine, dtype, device)
    # Before any tensor is read: a stage that cannot fit is one line (MemoryShortfall).
    (footprint,) = fit_process(model, [span or range(config.num_hidden_layers)], engine=engine,
                               dtype=dtype, kv_budget_bytes=kv_budget_bytes,
                               max_chunk_tokens=max_chunk_tokens,
                               max_compute_bytes=max_compute_bytes,
                               limit=limit.bytes if limit else None,
                               limit_source=limit.source if limit else "")  # fmt: skip
    kv_budget_bytes = footprint.kv
    # Reported from here on, not before: a stage refused above is one line only.
    report = (contextlib.nullcontext(NO_PROGRESS) if log_level is None else
              reporting(load_plan(model, span or range(config.num_hidden_layers), config),
                        level=log_level))  # fmt: skip
    # Once, at load: the identity reads the stage's share of the file and hashes
    # it (docs/models.md "Identity") in a thread beside the load — hashlib and
    # pread release the GIL — and a stage is returned only with it.
    with report as progress, ThreadPoolExecutor(1, thread_name_prefix="identity") as pool:
        pending = pool.submit(model_identity, model, span, config=config)
        runner = _runner(model, span, config, engine=engine, dtype=dtype, device=device,
                         threads=threads, kv_budget_bytes=kv_budget_bytes,
                         max_chunk_tokens=max_chunk_tokens,
                         max_compute_bytes=max_compute_bytes,
                         progress=progress, weights_cache=weights_cache)  # fmt: skip
        identity = pending.result()
    scheduling = {"max_batch_tokens": max_batch_tokens, "max_queued_tokens": max_queued_tokens,
                  "micro_batches": micro_batches}  # fmt: skip
    return ModelStage(runner, footprint=footprint, identity=identity, **scheduling)


def _runner(
    model: str | Path,
    span: range | None,
    config: ModelConfig,
    *,
    engine: str,
    dtype: str,
    device: str,
    threads: int | None,
    kv_budget_bytes: int,
    max_chunk_tokens: int,
    max_compute_bytes: int,
    progress: LoadProgress,
    weights_cache: str = "off",
) -> StageRunner:
    """The stage's runner on ``engine``, its tensors read."""
    if engine == "torch":
        return _torch_runner(model, span, config, dtype=dtype, device=device,
                             threads=threads, kv_budget_bytes=kv_budget_bytes,
                             max_chunk_tokens=max_chunk_tokens,
                             max_compute_bytes=max_compute_bytes,
                             progress=progress, weights_cache=weights_cache)  # fmt: skip
    if threads is not None:
        set_blas_threads(threads)  # process-wide: every numpy stage of it shares the pool
    weights = StageWeights.load(model, span, dtype=dtype, config=config, progress=progress)
    return StageRunner(weights, kv_budget_bytes=kv_budget_bytes,
                       max_chunk_tokens=max_chunk_tokens, max_compute_bytes=max_compute_bytes,
                       name=model_name(model), path=str(model))  # fmt: skip


def _torch_runner(
    model: str | Path,
    span: range | None,
    config: ModelConfig,
    *,
    dtype: str,
    device: str,
    threads: int | None,
    kv_budget_bytes: int,
    max_chunk_tokens: int,
    max_compute_bytes: int,
    progress: LoadProgress,
    weights_cache: str = "off",
) -> StageRunner:
    """The torch engine's runner; torch is imported only here (an optional extra)."""
    from meshnet_model.engines.torch import load_torch_runner

    return load_torch_runner(model, span, dtype=dtype, device=device, threads=threads,
                             kv_budget_bytes=kv_budget_bytes, config=config,
                             max_chunk_tokens=max_chunk_tokens,
                             max_compute_bytes=max_compute_bytes,
                             progress=progress, weights_cache=weights_cache)  # fmt: skip


def stage_from_config(config: NodeConfig) -> ModelStage:
    """The stage of ``--model/--layers/--dtype/--kv-budget-bytes``, its load
    reported at ``--log-level`` info (``meshnet_model.progress``: a line at the
    start and the end, a bar on a terminal, steps for a slow load)."""
    if config.model is None:
        raise ValueError("no --model given")
    stage = load_model_stage(config.model, config.layers, dtype=config.dtype,
                            kv_budget_bytes=config.kv_budget_bytes,
                            max_chunk_tokens=config.max_chunk_tokens,
                            max_compute_bytes=config.max_compute_bytes, engine=config.engine,
                            device=config.device, threads=config.threads,
                            limit=limit_from_flag(config.memory_limit),
                            max_batch_tokens=config.max_batch_tokens,
                            max_queued_tokens=config.max_queued_tokens,
                            micro_batches=config.micro_batches,
                            log_level=config.log_level,
                            weights_cache=config.weights_cache)  # fmt: skip
    if isinstance(config.prefix_cache_bytes, int):  # auto: the runner's half of the budget
        stage.runner.prefix.limit = config.prefix_cache_bytes
    if config.share_cores_with is not None:  # each step's threads by who is busy (core_ledger)
        engine = stage.runner.model.describe()
        stage.scheduler.cores = ledger_for(config.share_cores_with, engine, config.threads)
    return stage

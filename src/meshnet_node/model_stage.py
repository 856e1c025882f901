"""Loading a node's model stage: ``load_model_stage`` (the node's flags as
arguments) and ``stage_from_config`` (a ``NodeConfig``).

Before a tensor is read the stage's footprint is fitted to the memory it
may use (``engines.fit``); the model's identity is hashed beside the load.
The stage itself, ``ModelStage``, is ``model_backend``'s (re-exported here).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

from meshnet_model import StageRunner, StageWeights, parse_layers
from meshnet_model.engines.choice import choose_engine, set_blas_threads
from meshnet_model.engines.core_ledger import ledger_for
from meshnet_model.engines.fit import fit_process
from meshnet_model.formats.config import ModelConfig
from meshnet_model.identity import load_plan
from meshnet_model.identity import (
    model_identity as model_identity,  # bench/identity patches it here
)
from meshnet_model.progress import NO_PROGRESS, LoadProgress, reporting
from meshnet_model.source import load_config, model_name
from meshnet_model.stage.runner import DEFAULT_MAX_CHUNK_TOKENS, DEFAULT_MAX_COMPUTE_BYTES
from meshnet_runtime.memory import MemoryLimit, limit_from_flag

from .config import NodeConfig
from .model_backend import KV_RETRY_AFTER, ModelStage
from .scheduler import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS

__all__ = ["KV_RETRY_AFTER", "ModelStage", "load_model_stage", "stage_from_config"]


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
    (footprint,) = fit_process(
        model,
        [span or range(config.num_hidden_layers)],
        engine=engine,
        dtype=dtype,
        kv_budget_bytes=kv_budget_bytes,
        max_chunk_tokens=max_chunk_tokens,
        max_compute_bytes=max_compute_bytes,
        limit=limit.bytes if limit else None,
        limit_source=limit.source if limit else "",
    )
    kv_budget_bytes = footprint.kv
    # Reported from here on, not before: a stage refused above is one line only.
    report = _load_report(model, span, config, log_level)
    # Once, at load: the identity reads the stage's share of the file and hashes
    # it (docs/models.md "Identity") in a thread beside the load — hashlib and
    # pread release the GIL — and a stage is returned only with it.
    with report as progress, ThreadPoolExecutor(1, thread_name_prefix="identity") as pool:
        pending = pool.submit(model_identity, model, span, config=config)
        runner = _runner(
            model,
            span,
            config,
            engine=engine,
            dtype=dtype,
            device=device,
            threads=threads,
            kv_budget_bytes=kv_budget_bytes,
            max_chunk_tokens=max_chunk_tokens,
            max_compute_bytes=max_compute_bytes,
            progress=progress,
            weights_cache=weights_cache,
        )
        identity = pending.result()
    scheduling = {
        "max_batch_tokens": max_batch_tokens,
        "max_queued_tokens": max_queued_tokens,
        "micro_batches": micro_batches,
    }
    return ModelStage(runner, footprint=footprint, identity=identity, **scheduling)


def _load_report(
    model: str | Path, span: range | None, config: ModelConfig, log_level: str | None
) -> AbstractContextManager[LoadProgress]:
    """Where the load's progress goes: nowhere without a ``log_level``."""
    if log_level is None:
        return contextlib.nullcontext(NO_PROGRESS)
    plan = load_plan(model, span or range(config.num_hidden_layers), config)
    return reporting(plan, level=log_level)


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
        return _torch_runner(
            model,
            span,
            config,
            dtype=dtype,
            device=device,
            threads=threads,
            kv_budget_bytes=kv_budget_bytes,
            max_chunk_tokens=max_chunk_tokens,
            max_compute_bytes=max_compute_bytes,
            progress=progress,
            weights_cache=weights_cache,
        )
    if threads is not None:
        set_blas_threads(threads)  # process-wide: every numpy stage of it shares the pool
    weights = StageWeights.load(model, span, dtype=dtype, config=config, progress=progress)
    return StageRunner(
        weights,
        kv_budget_bytes=kv_budget_bytes,
        max_chunk_tokens=max_chunk_tokens,
        max_compute_bytes=max_compute_bytes,
        name=model_name(model),
        path=str(model),
    )


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

    return load_torch_runner(
        model,
        span,
        dtype=dtype,
        device=device,
        threads=threads,
        kv_budget_bytes=kv_budget_bytes,
        config=config,
        max_chunk_tokens=max_chunk_tokens,
        max_compute_bytes=max_compute_bytes,
        progress=progress,
        weights_cache=weights_cache,
    )


def stage_from_config(config: NodeConfig) -> ModelStage:
    """The stage of ``--model/--layers/--dtype/--kv-budget-bytes``, its load
    reported at ``--log-level`` info (``meshnet_model.progress``: a line at the
    start and the end, a bar on a terminal, steps for a slow load)."""
    if config.model is None:
        raise ValueError("no --model given")
    stage = load_model_stage(
        config.model,
        config.layers,
        dtype=config.dtype,
        kv_budget_bytes=config.kv_budget_bytes,
        max_chunk_tokens=config.max_chunk_tokens,
        max_compute_bytes=config.max_compute_bytes,
        engine=config.engine,
        device=config.device,
        threads=config.threads,
        limit=limit_from_flag(config.memory_limit),
        max_batch_tokens=config.max_batch_tokens,
        max_queued_tokens=config.max_queued_tokens,
        micro_batches=config.micro_batches,
        log_level=config.log_level,
        weights_cache=config.weights_cache,
    )
    if isinstance(config.prefix_cache_bytes, int):  # auto: the runner's half of the budget
        stage.runner.prefix.limit = config.prefix_cache_bytes
    if config.share_cores_with is not None:  # each step's threads by who is busy (core_ledger)
        engine = stage.runner.model.describe()
        stage.scheduler.cores = ledger_for(config.share_cores_with, engine, config.threads)
    return stage

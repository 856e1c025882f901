"""The one line of a ``MemoryShortfall``: what stages need against a limit,
then flags that would make them fit under that same limit.

The need is ``footprint.least_need`` — weights, scratch, runtime and the KV
budget (``auto``: its least) — so it does not move with the limit it is
checked against. Each piece of advice is checked with the same figures the
node checks at start (``fit_process``), so a node started with the advised
flags under the same limit starts; where no one flag is enough, two together
(a smaller chunk and the least KV budget) are tried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .choice import torch_installed
from .footprint import (
    KV_AUTO_MIN,
    RUNTIME_BYTES,
    MiB,
    ModelBytes,
    StageFootprint,
    format_bytes,
    least_need,
    model_bytes,
    stage_scratch,
)

__all__ = ["Request", "shortfall"]

CHUNKS = (512, 256, 128)  # --max-chunk-tokens to advise; the gateway sends 128 by default


@dataclass(frozen=True, slots=True)
class Request:
    """What the process was asked to run with, and the limit it was held to."""

    model_path: str | Path
    max_chunk_tokens: int
    max_compute_bytes: int
    limit: int
    source: str


def shortfall(
    mb: ModelBytes, stages: list[StageFootprint], kv: int | None, asked: Request, who: str
) -> str:
    """The line (module doc); ``kv`` None: ``--kv-budget-bytes auto``."""
    n = len(stages)
    ranges = ", ".join(f"{s.layers.start}:{s.layers.stop}" for s in stages)
    kv_text = (
        format_bytes(n * kv) if kv is not None else f"{format_bytes(n * KV_AUTO_MIN)} at least"
    )
    parts = [
        f"weights {format_bytes(sum(s.weights for s in stages))} "
        f"{'+'.join(sorted({s.form for s in stages}))}",
        f"KV {kv_text}",
        f"scratch {format_bytes(sum(s.scratch for s in stages))}",
        f"runtime {format_bytes(RUNTIME_BYTES[mb.engine])}",
    ]
    where = f" ({asked.source})" if asked.source else ""
    head = (
        f"layers {ranges} of {Path(asked.model_path).name}{' in one process' if n > 1 else ''} "
        f"need {_rounded_up(least_need(stages, kv))} ({', '.join(parts)}) but {who} may use "
        f"{format_bytes(asked.limit)}{where}"
    )
    fits = [_fewer_layers(mb, stages[0], kv, asked.limit)] if n == 1 else []
    fits += _flags_that_fit(mb, stages, kv, asked)
    return head + (": " + ", or ".join(fits) if fits else "")


def _rounded_up(n: int) -> str:
    """The need as a limit that fits: rounded up, never down, to the figure shown."""
    step = MiB if n < 1024 * MiB else 1024 * MiB // 10
    return format_bytes(-(-n // step) * step)


def _need_with(
    mb: ModelBytes, stages: Sequence[StageFootprint], kv: int | None, chunk: int, asked: Request
) -> int:
    """What ``stages`` need held by ``mb``'s engine with chunks of ``chunk`` tokens."""
    rebuilt = [
        StageFootprint(
            s.layers,
            mb.engine,
            mb.dtype,
            mb.form(s.layers),
            mb.weights(s.layers),
            kv or KV_AUTO_MIN,
            stage_scratch(mb, s.layers, chunk, asked.max_compute_bytes, kv or KV_AUTO_MIN),
            RUNTIME_BYTES[mb.engine],
        )
        for s in stages
    ]
    return least_need(rebuilt, kv)


def _kv_flag(
    mb: ModelBytes, stages: list[StageFootprint], kv: int, chunk: int, asked: Request
) -> str:
    """The largest ``--kv-budget-bytes`` (whole MiB, halving from ``kv``) that fits
    with ``chunk``, or "" where not even the least does."""
    trial = kv // MiB * MiB
    while trial > KV_AUTO_MIN:
        if _need_with(mb, stages, trial, chunk, asked) <= asked.limit:
            return f"--kv-budget-bytes {trial // MiB}MiB"
        trial = max(KV_AUTO_MIN, trial // 2 // MiB * MiB)
    if _need_with(mb, stages, KV_AUTO_MIN, chunk, asked) <= asked.limit:
        return f"--kv-budget-bytes {KV_AUTO_MIN // MiB}MiB"
    return ""


def _flags_that_fit(
    mb: ModelBytes, stages: list[StageFootprint], kv: int | None, asked: Request
) -> list[str]:
    """Flag sets, each fitting by itself: a smaller KV budget, a smaller chunk
    (the scratch is the longest chunk a peer may send), both, another engine."""
    fits: list[str] = []
    if kv is not None and (smaller := _kv_flag(mb, stages, kv, asked.max_chunk_tokens, asked)):
        fits.append(smaller)
    for chunk in (c for c in CHUNKS if c < asked.max_chunk_tokens):
        if _need_with(mb, stages, kv, chunk, asked) <= asked.limit:
            fits.append(f"--max-chunk-tokens {chunk}")
            break
    else:  # no chunk alone (nor, above, a budget alone): the least chunk, a smaller budget
        chunk = min([asked.max_chunk_tokens, *CHUNKS])
        budget = _kv_flag(mb, stages, kv, chunk, asked) if kv is not None and not fits else ""
        if budget and chunk < asked.max_chunk_tokens:
            fits.append(f"--max-chunk-tokens {chunk} {budget}")
    fits += _other_engine(mb, stages, kv, asked)
    return fits


def _fewer_layers(mb: ModelBytes, stage: StageFootprint, kv: int | None, limit: int) -> str:
    """How many of one stage's layers would fit beside its scratch, runtime and KV."""
    span = stage.layers
    first, last = span.start == 0, span.stop == mb.config.num_hidden_layers
    room = limit - stage.scratch - stage.runtime - (KV_AUTO_MIN if kv is None else kv)
    for m in range(len(span) - 1, 0, -1):
        if mb.weights(range(span.start, span.start + m), first=first, last=last) <= room:
            return f"{m} layer{'s' if m != 1 else ''} would fit"
    return "not one layer would fit" + (" with this KV budget" if kv is not None else "")


def _other_engine(
    mb: ModelBytes, stages: list[StageFootprint], kv: int | None, asked: Request
) -> list[str]:
    """The first other engine and dtype (in order of preference) that would fit."""
    torch_ok = torch_installed()
    for engine, dtype in (
        ("torch", "keep"),
        ("torch", "bfloat16"),
        ("numpy", "bfloat16"),
        ("numpy", "keep"),
    ):
        if (engine, dtype) == (mb.engine, mb.dtype) or (engine == "torch" and not torch_ok):
            continue
        alt = model_bytes(asked.model_path, engine, dtype, mb.config)
        if _need_with(alt, stages, kv, asked.max_chunk_tokens, asked) <= asked.limit:
            if engine == "torch" and dtype == "keep" and alt.quantized:
                return ["--engine torch (quantized)"]
            return [f"--engine {engine} --dtype {dtype}"]
    return []

"""What a stage will hold in memory, computed from the config and the headers alone.

``stage_footprint(path, layers, engine=..., dtype=...)`` adds up, before any
tensor is read, the bytes a node holding ``layers`` keeps resident:

* ``weights``: every tensor in the form the engine holds it
  (``held_bytes.held_matrix_bytes`` is the one table of those forms, docs/models.md);
* ``kv``: the KV cache budget (``--kv-budget-bytes``);
* ``scratch``: one chunk's compute scratch, ``costs.chunk_cost`` of
  ``--max-chunk-tokens`` rows over the whole context, capped by
  ``--max-compute-bytes``; plus, on a quantized torch stage, the buffer its
  dense tiles decode weights into (``torch.dense_tiles.scratch_bytes``, a
  few MiB per core);
* ``runtime``: the process's own baseline (interpreter, libraries).

``fit_process`` checks stages that share one process (a node: one; ``meshnet
run``: all of them, with one runtime) against a memory limit, resolves
``--kv-budget-bytes auto``, and raises ``MemoryShortfall`` with one line that
says what would fit. ``plan_split`` proposes layer ranges for machines of
given memories. Nothing here reads the machine: the limit is a parameter.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats.config import ModelConfig
from ..stage.costs import QUERY_BLOCK, chunk_cost, reachable_context
from .choice import choose_engine, torch_installed, usable_cores
from .held_bytes import ModelBytes, held_matrix, held_matrix_bytes, model_bytes
from .torch.dense_tiles import scratch_bytes as tile_scratch_bytes

__all__ = [
    "KV_AUTO_MAX",
    "KV_AUTO_MIN",
    "RUNTIME_BYTES",
    "MemoryShortfall",
    "ModelBytes",
    "StageFootprint",
    "default_engine",
    "fit_process",
    "format_bytes",
    "held_matrix",
    "held_matrix_bytes",
    "model_bytes",
    "parse_size",
    "plan_split",
    "stage_footprint",
]

MiB, GiB = 1024**2, 1024**3
# The process's own resident memory before any weight, measured as VmRSS of
# /proc/PID/status (Linux x86-64, Python 3.11): an idle `meshnet-node
# --backend echo` 49 MiB, a node serving a 4-layer test GGUF with the numpy
# engine 55 MiB, with the torch engine (torch 2.13 CPU imported) 237 MiB.
# Rounded up, for what a real run adds (threads' stacks, allocator arenas).
RUNTIME_BYTES = {"numpy": 64 * MiB, "torch": 320 * MiB}
KV_AUTO_MAX = 1 * GiB  # --kv-budget-bytes auto: at most this...
KV_AUTO_MIN = 64 * MiB  # ...and refused below this
MARGIN = 0.05  # auto leaves this share of the limit free

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024 * GiB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """``"16GiB"`` → bytes (``plan --memory``; the node's flags parse theirs in meshnet_runtime)."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"expected bytes such as 16GiB, 512MiB or 8GB, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive number of bytes, got {text!r}")
    return value


def format_bytes(n: int) -> str:
    """A reader's figure: ``1.0 GiB``, ``256 MiB``, ``12 KiB``."""
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.0f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n} B"


@dataclass(frozen=True, slots=True)
class StageFootprint:
    layers: range
    engine: str
    dtype: str
    form: str  # how the matrices are held: int4pack, int8, bf16, float32, ...
    weights: int
    kv: int
    scratch: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch + self.runtime

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [self.layers.start, self.layers.stop],
            "engine": self.engine,
            "dtype": self.dtype,
            "form": self.form,
            "weights": self.weights,
            "kv": self.kv,
            "scratch": self.scratch,
            "runtime": self.runtime,
            "total": self.total,
        }

    def describe(self) -> str:
        return (
            f"weights {format_bytes(self.weights)} {self.form}, KV {format_bytes(self.kv)}, "
            f"scratch {format_bytes(self.scratch)}, runtime {format_bytes(self.runtime)}"
        )


def _kv_itemsize(mb: ModelBytes) -> int:
    """Bytes of one cached key/value element as the engine holds them: numpy and
    a quantized torch stage float32; torch otherwise its compute dtype (2 for a
    float checkpoint kept as it is: the longer context, the larger estimate)."""
    if mb.engine == "numpy" or mb.dtype == "float32" or (mb.dtype == "keep" and mb.quantized):
        return 4
    return 2


def _scratch(
    config: ModelConfig,
    layers: range,
    engine: str,
    max_chunk_tokens: int,
    max_compute_bytes: int,
    kv: int = KV_AUTO_MAX,
    kv_itemsize: int = 2,
) -> int:
    # Scores over the longest context a session can reach under this KV budget:
    # the runner costs chunks the same way (stage.costs.reachable_context).
    context = reachable_context(config, layers=len(layers), batch=1, kv_budget=kv or KV_AUTO_MAX,
                                kv_itemsize=kv_itemsize)  # fmt: skip
    cost = chunk_cost(
        config,
        batch=1,
        tokens=max_chunk_tokens,
        context=context,
        last=layers.stop == config.num_hidden_layers,
        query_block=QUERY_BLOCK,
    )
    return min(max_compute_bytes, cost.total)


def _tile_scratch(mb: ModelBytes, layers: range) -> int:
    """The dense tiles' decode buffers of a stage holding int4pack matrices
    (whichever kernel its calibration picks: the footprint is planned
    before), one per worker thread: at most one per usable core."""
    if not any("int4pack" in form for i in layers for form in mb.forms[i]):
        return 0
    cols = max(mb.config.hidden_size, mb.config.intermediate_size)
    return tile_scratch_bytes(cols, usable_cores())


def _stage_scratch(
    mb: ModelBytes, layers: range, max_chunk_tokens: int, max_compute_bytes: int, kv: int
) -> int:
    """A stage's whole scratch: its chunk's (``_scratch``) and its dense tiles'."""
    chunk = _scratch(
        mb.config, layers, mb.engine, max_chunk_tokens, max_compute_bytes, kv, _kv_itemsize(mb)
    )
    return chunk + _tile_scratch(mb, layers)


def _footprint(
    mb: ModelBytes, layers: range, kv: int, max_chunk_tokens: int, max_compute_bytes: int
) -> StageFootprint:
    return StageFootprint(
        layers,
        mb.engine,
        mb.dtype,
        mb.form(layers),
        mb.weights(layers),
        kv,
        _stage_scratch(mb, layers, max_chunk_tokens, max_compute_bytes, kv),
        RUNTIME_BYTES[mb.engine],
    )


def stage_footprint(
    model_path: str | Path,
    layers: range,
    *,
    engine: str,
    dtype: str,
    kv_budget_bytes: int,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> StageFootprint:
    """The resident bytes of a node holding ``layers`` (module doc); headers only."""
    engine, dtype = choose_engine(model_path, engine, dtype)
    mb = model_bytes(model_path, engine, dtype)
    return _footprint(mb, layers, kv_budget_bytes, max_chunk_tokens, max_compute_bytes)


def default_engine(model_path: str | Path) -> tuple[str, str]:
    """(engine, dtype) a node picks by default (``engines.choice``): torch keeping
    a GGUF file's quantized form when torch is installed, else numpy float32."""
    return choose_engine(model_path, "auto", "auto")


class MemoryShortfall(ValueError):
    """The stages need more memory than the limit: the message says what would fit."""


def _kv_for(limit: int, fixed: int, stages: int) -> int:
    """``--kv-budget-bytes auto`` under ``limit``: per stage, 0 if none is left."""
    return max(0, min(KV_AUTO_MAX, (limit - fixed - int(limit * MARGIN)) // stages))


def fit_process(
    model_path: str | Path,
    ranges: Sequence[range],
    *,
    engine: str,
    dtype: str,
    kv_budget_bytes: int | str,
    max_chunk_tokens: int,
    max_compute_bytes: int,
    limit: int | None,
    limit_source: str = "",
    who: str = "this node",
) -> list[StageFootprint]:
    """The footprints of ``ranges`` run in one process (one runtime in all), the
    KV budget resolved (``"auto"``: module doc); raises ``MemoryShortfall``
    when they do not fit ``limit`` (None: no limit known, no check)."""
    engine, dtype = choose_engine(model_path, engine, dtype)
    mb = model_bytes(model_path, engine, dtype)
    n, auto = len(ranges), kv_budget_bytes == "auto"

    def stages_at(kv: int) -> list[StageFootprint]:
        return [_footprint(mb, r, kv, max_chunk_tokens, max_compute_bytes) for r in ranges]

    def refuse(stages: list[StageFootprint], kv: int | None) -> MemoryShortfall:
        return MemoryShortfall(
            _shortfall(
                mb,
                stages,
                kv,
                limit or 0,
                limit_source,
                who,
                model_path,
                max_chunk_tokens,
                max_compute_bytes,
            )
        )

    if not auto:
        kv = int(kv_budget_bytes)
        stages = stages_at(kv)
        if (
            limit is not None
            and sum(s.total - s.runtime for s in stages) + RUNTIME_BYTES[engine] > limit
        ):
            raise refuse(stages, kv)
        return stages
    if limit is None:
        return stages_at(KV_AUTO_MAX)
    # auto: the scratch depends on the budget (the context a session can reach),
    # the budget on what the scratch leaves. Try budgets from large to small and
    # take the first that what is left can hold: at most that budget, so its
    # scratch is at most the one the room was computed with.
    for trial in (KV_AUTO_MAX, 512 * MiB, 256 * MiB, 128 * MiB, KV_AUTO_MIN):
        fixed = sum(s.weights + s.scratch for s in stages_at(trial)) + RUNTIME_BYTES[engine]
        kv = min(trial, _kv_for(limit, fixed, n))
        if kv >= KV_AUTO_MIN:
            return [dataclasses.replace(s, kv=kv) for s in stages_at(kv)]
    raise refuse(stages_at(KV_AUTO_MIN), None)


def _needs(kv: int | None, limit: int, stages: int) -> int:
    """Bytes needed beside weights, scratch and runtime: the KV (auto: its least, plus margin)."""
    return stages * kv if kv is not None else stages * KV_AUTO_MIN + int(limit * MARGIN)


def _shortfall(
    mb: ModelBytes,
    stages: list[StageFootprint],
    kv: int | None,
    limit: int,
    source: str,
    who: str,
    model_path: str | Path,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> str:
    """The one line of a ``MemoryShortfall``: what the stages need against
    ``limit``, then what would fit instead."""
    n = len(stages)
    runtime = RUNTIME_BYTES[mb.engine]
    weights = sum(s.weights for s in stages)
    scratch = sum(s.scratch for s in stages)
    fixed = weights + scratch + runtime
    need = fixed + _needs(kv, limit, n)
    ranges = ", ".join(f"{s.layers.start}:{s.layers.stop}" for s in stages)
    kv_text = (
        format_bytes(n * kv) if kv is not None else f"{format_bytes(n * KV_AUTO_MIN)} at least"
    )
    parts = [
        f"weights {format_bytes(weights)} {'+'.join(sorted({s.form for s in stages}))}",
        f"KV {kv_text}",
        f"scratch {format_bytes(scratch)}",
        f"runtime {format_bytes(runtime)}",
    ]
    if kv is None:
        parts.append(f"{MARGIN:.0%} margin {format_bytes(int(limit * MARGIN))}")
    where = f" ({source})" if source else ""
    head = (
        f"layers {ranges} of {Path(model_path).name}{' in one process' if n > 1 else ''} "
        f"need {format_bytes(need)} ({', '.join(parts)}) but {who} may use "
        f"{format_bytes(limit)}{where}"
    )
    fits: list[str] = []
    if n == 1:
        fits.append(_fewer_layers(mb, stages[0].layers, kv, limit, scratch + runtime))
    if kv is not None and (limit - fixed) // n >= KV_AUTO_MIN:
        fits.append(f"--kv-budget-bytes {(limit - fixed) // n // MiB}MiB")
    fits += _smaller_chunk(mb, stages, kv, limit, max_chunk_tokens, max_compute_bytes)
    fits += _other_engine(mb, stages, kv, limit, model_path, max_chunk_tokens, max_compute_bytes)
    return head + (": " + ", or ".join(fits) if fits else "")


def _fewer_layers(mb: ModelBytes, span: range, kv: int | None, limit: int, beside: int) -> str:
    """How many of one stage's layers would fit, ``beside`` (its scratch and
    runtime) and the KV taken."""
    first, last = span.start == 0, span.stop == mb.config.num_hidden_layers
    room = limit - beside - _needs(kv, limit, 1)
    count = 0
    for m in range(len(span) - 1, 0, -1):
        if mb.weights(range(span.start, span.start + m), first=first, last=last) <= room:
            count = m
            break
    with_kv = " with this KV budget" if kv is not None else ""
    if count:
        return f"{count} layer{'s' if count != 1 else ''} would fit"
    return f"not one layer would fit{with_kv}"


def _smaller_chunk(
    mb: ModelBytes,
    stages: list[StageFootprint],
    kv: int | None,
    limit: int,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> list[str]:
    """The largest smaller ``--max-chunk-tokens`` that would fit, if one does.

    The scratch is what the longest chunk a peer may send costs; the gateway
    sends 128 tokens by default, so a smaller --max-chunk-tokens may be the fix.
    """
    weights = sum(s.weights for s in stages)
    beside = RUNTIME_BYTES[mb.engine] + _needs(kv, limit, len(stages))
    for tokens in (512, 256, 128):
        if tokens >= max_chunk_tokens:
            continue
        smaller = sum(
            _stage_scratch(mb, s.layers, tokens, max_compute_bytes, kv or KV_AUTO_MIN)
            for s in stages
        )
        if weights + smaller + beside <= limit:
            return [f"--max-chunk-tokens {tokens}"]
    return []


def _other_engine(
    mb: ModelBytes,
    stages: list[StageFootprint],
    kv: int | None,
    limit: int,
    model_path: str | Path,
    max_chunk_tokens: int,
    max_compute_bytes: int,
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
        alt = model_bytes(model_path, engine, dtype, mb.config)
        alt_fixed = RUNTIME_BYTES[engine] + sum(
            alt.weights(s.layers)
            + _stage_scratch(alt, s.layers, max_chunk_tokens, max_compute_bytes, kv or KV_AUTO_MIN)
            for s in stages
        )
        if alt_fixed + _needs(kv, limit, len(stages)) <= limit:
            if engine == "torch" and dtype == "keep" and alt.quantized:
                return ["--engine torch (quantized)"]
            return [f"--engine {engine} --dtype {dtype}"]
    return []


def plan_split(
    model_path: str | Path,
    memories: Sequence[int],
    *,
    engine: str,
    dtype: str,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> list[StageFootprint]:
    """Contiguous layer ranges, one per machine of ``memories`` bytes (in order),
    each stage's total (KV ``auto`` under that machine) within its machine,
    the layers' held bytes spread to balance how full the machines are.
    Raises ``MemoryShortfall`` when no split fits."""
    mb = model_bytes(model_path, engine, dtype)
    layers, stages = mb.config.num_hidden_layers, len(memories)
    if not 1 <= stages <= layers:
        raise ValueError(f"machines must be 1..{layers} (the model has {layers} layers)")

    def room(k: int, span: range) -> int:  # weights room of machine k holding span
        scratch = _scratch(mb.config, span, engine, max_chunk_tokens, max_compute_bytes)
        scratch += _tile_scratch(mb, span)
        return memories[k] - scratch - RUNTIME_BYTES[engine] - _needs(None, memories[k], 1)

    def cut(share: float) -> list[int] | None:
        """Greedy: each machine takes layers up to ``share`` of its room."""
        bounds = [0]
        for k in range(stages):
            start, keep = bounds[-1], stages - 1 - k  # layers left for the machines after
            stop = layers - keep if k == stages - 1 else start
            if k < stages - 1:
                while stop < layers - keep and mb.weights(range(start, stop + 1)) <= share * room(
                    k, range(start, stop + 1)
                ):
                    stop += 1
            span = range(start, stop)
            if stop == start or mb.weights(span) > share * room(k, span):
                return None
            bounds.append(stop)
        return bounds

    best = cut(1.0)
    if best is None:
        total = mb.weights(range(layers))
        raise MemoryShortfall(
            f"no split of the {layers} layers of {Path(model_path).name} fits machines of "
            f"{', '.join(format_bytes(m) for m in memories)} ({engine} {dtype}: weights "
            f"{format_bytes(total)} {mb.form(range(layers))} in all, and each machine needs "
            f"scratch, runtime {format_bytes(RUNTIME_BYTES[engine])} and KV "
            f"{format_bytes(KV_AUTO_MIN)} at least beside its layers)"
        )
    low, high = 0.0, 1.0  # the least share of room at which the greedy split fits
    for _ in range(40):
        mid = (low + high) / 2
        found = cut(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    result = []
    for k, (a, b) in enumerate(itertools.pairwise(best)):
        fp = _footprint(mb, range(a, b), 0, max_chunk_tokens, max_compute_bytes)
        kv = _kv_for(memories[k], fp.weights + fp.scratch + fp.runtime, 1)
        result.append(dataclasses.replace(fp, kv=kv))
    return result

"""Where a model's layers are cut into stages: the one split every command uses.

``even_splits`` is the split of ``meshnet run --stages N``, of ``plan --stages
N`` and of the benches: N contiguous ranges whose sizes differ by at most one
layer, since every decoder layer costs the same compute and the pipeline runs
at its slowest stage. ``plan_split`` is the split for machines of given
memories: the even split where it fits every machine, else layers moved
towards the machines with room, balancing how full they are — so machines
with room to spare get the split ``meshnet run`` would have chosen.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

from .engines.fit import fit_process
from .engines.footprint import (
    KV_AUTO_MIN,
    RUNTIME_BYTES,
    MemoryShortfall,
    StageFootprint,
    format_bytes,
    model_bytes,
    stage_scratch,
)
from .engines.held_bytes import ModelBytes

__all__ = ["even_splits", "plan_split"]


def even_splits(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous layer ranges covering ``0..num_layers``, sizes within one."""
    bounds = [round(k * num_layers / stages) for k in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def plan_split(
    model_path: str | Path,
    memories: Sequence[int],
    *,
    engine: str,
    dtype: str,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> list[StageFootprint]:
    """One contiguous layer range per machine of ``memories`` bytes (in order),
    each stage fitting its machine with ``--kv-budget-bytes auto`` there
    (module doc). Raises ``MemoryShortfall`` when no split fits."""
    mb = model_bytes(model_path, engine, dtype)
    layers, stages = mb.config.num_hidden_layers, len(memories)
    if not 1 <= stages <= layers:
        raise ValueError(f"machines must be 1..{layers} (the model has {layers} layers)")

    def fit(span: range, limit: int | None) -> StageFootprint:
        (fp,) = fit_process(
            model_path,
            [span],
            engine=engine,
            dtype=dtype,
            kv_budget_bytes="auto",
            max_chunk_tokens=max_chunk_tokens,
            max_compute_bytes=max_compute_bytes,
            limit=limit,
        )
        return fp

    def on(k: int, span: range) -> StageFootprint:
        """Stage ``span`` on machine ``k``, its KV what ``auto`` gives it there (0: no fit)."""
        try:
            return fit(span, memories[k])
        except MemoryShortfall:
            return dataclasses.replace(fit(span, None), kv=0)

    even = [on(k, range(a, b)) for k, (a, b) in enumerate(even_splits(layers, stages))]
    if all(fp.kv for fp in even):
        return even
    bounds = _balanced(mb, memories, max_chunk_tokens, max_compute_bytes)
    if bounds is None:
        raise MemoryShortfall(
            f"no split of the {layers} layers of {Path(model_path).name} fits machines of "
            f"{', '.join(format_bytes(m) for m in memories)} ({engine} {dtype}: weights "
            f"{format_bytes(mb.weights(range(layers)))} {mb.form(range(layers))} in all, and "
            f"each machine needs scratch, runtime {format_bytes(RUNTIME_BYTES[engine])} and KV "
            f"{format_bytes(KV_AUTO_MIN)} at least beside its layers)"
        )
    return [on(k, range(a, b)) for k, (a, b) in enumerate(itertools.pairwise(bounds))]


def _balanced(
    mb: ModelBytes, memories: Sequence[int], max_chunk_tokens: int, max_compute_bytes: int
) -> list[int] | None:
    """Bounds filling every machine to the least common share of its room for
    weights (a bisection over that share), or None where none fits."""
    layers, stages = mb.config.num_hidden_layers, len(memories)

    def room(k: int, span: range) -> int:  # weights room of machine k holding span
        scratch = stage_scratch(mb, span, max_chunk_tokens, max_compute_bytes, KV_AUTO_MIN)
        return memories[k] - scratch - RUNTIME_BYTES[mb.engine] - KV_AUTO_MIN

    def cut(share: float) -> list[int] | None:
        """Greedy: each machine takes layers up to ``share`` of its room."""
        bounds = [0]
        for k in range(stages):
            start, keep = bounds[-1], stages - 1 - k  # layers left for the machines after
            stop = layers - keep if k == stages - 1 else start
            while k < stages - 1 and stop < layers - keep:
                if mb.weights(range(start, stop + 1)) > share * room(k, range(start, stop + 1)):
                    break
                stop += 1
            span = range(start, stop)
            if stop == start or mb.weights(span) > share * room(k, span):
                return None
            bounds.append(stop)
        return bounds

    best = cut(1.0)
    if best is None:
        return None
    low, high = 0.0, 1.0  # the least share of room at which the greedy split fits
    for _ in range(40):
        mid = (low + high) / 2
        found = cut(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    return best

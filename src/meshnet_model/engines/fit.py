"""``fit_process``: stages run in one process against a memory limit.

A node checks its one stage, ``meshnet run`` all of its stages with one
runtime, before any tensor is read: ``--kv-budget-bytes auto`` resolved to
what the limit leaves (``footprint`` module doc), or ``MemoryShortfall``
raised with the one line ``shortfall`` writes. Apart from ``footprint`` so
that the figures and the advice built on them import in one direction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .choice import choose_engine
from .footprint import (
    KV_AUTO_MAX,
    KV_AUTO_MIN,
    MARGIN,
    RUNTIME_BYTES,
    MemoryShortfall,
    MiB,
    StageFootprint,
    footprint_of,
    least_need,
    model_bytes,
)
from .shortfall import Request, shortfall

__all__ = ["fit_process"]


def _kv_for(limit: int, fixed: int, stages: int) -> int:
    """``--kv-budget-bytes auto`` under ``limit``, per stage: what is left less
    the margin, up to 1 GiB; never below the least budget where the limit holds
    that (the margin is taken from what is above it, so a limit of exactly the
    need fits); 0 where it does not."""
    room = (limit - fixed) // stages
    if room < KV_AUTO_MIN:
        return 0
    return max(KV_AUTO_MIN, min(KV_AUTO_MAX, (limit - fixed - int(limit * MARGIN)) // stages))


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
        return [footprint_of(mb, r, kv, max_chunk_tokens, max_compute_bytes) for r in ranges]

    def refuse(stages: list[StageFootprint], kv: int | None) -> MemoryShortfall:
        asked = Request(model_path, max_chunk_tokens, max_compute_bytes, limit or 0, limit_source)
        return MemoryShortfall(shortfall(mb, stages, kv, asked, who))

    if not auto:
        kv = int(kv_budget_bytes)
        stages = stages_at(kv)
        if limit is not None and least_need(stages, kv) > limit:
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

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

``fit.fit_process`` checks stages that share one process (a node: one; ``meshnet
run``: all of them, with one runtime) against a memory limit, resolves
``--kv-budget-bytes auto``, and raises ``MemoryShortfall`` with one line that
says what would fit (``shortfall``). What a process *needs* is its weights,
scratch and runtime plus the KV budget (``auto``: its least, 64 MiB) — the
same figure whatever limit it is checked against; ``auto`` then gives the KV
what the limit leaves beyond that, less a margin. ``meshnet_model.split``
proposes layer ranges for machines of given memories. Nothing here reads the
machine: the limit is a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats.config import ModelConfig
from ..stage.costs import QUERY_BLOCK, chunk_cost, reachable_context
from .choice import choose_engine, usable_cores
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
    "footprint_of",
    "least_need",
    "format_bytes",
    "held_matrix",
    "held_matrix_bytes",
    "model_bytes",
    "parse_size",
    "stage_footprint",
    "stage_scratch",
]

MiB, GiB = 1024**2, 1024**3
# The process's own resident memory before any weight, measured as VmRSS of
# /proc/PID/status (Linux x86-64, Python 3.11): an idle `meshnet-node
# --backend echo` 49 MiB, a node serving a 4-layer test GGUF with the numpy
# engine 55 MiB, with the torch engine (torch 2.13 CPU imported) 237 MiB.
# Rounded up, for what a real run adds (threads' stacks, allocator arenas):
# SmolLM2-135M Q4_1 whole on torch measured 377 MiB after a 64-token prompt,
# 431 after 512 and 481 after 1,400 (HWM 498), against a need of 507 MiB
# with 256 here; 320 overstated every torch stage by a quarter (issue 43).
RUNTIME_BYTES = {"numpy": 64 * MiB, "torch": 256 * MiB}
KV_AUTO_MAX = 1 * GiB  # --kv-budget-bytes auto: at most this...
KV_AUTO_MIN = 64 * MiB  # ...and refused below this
MARGIN = 0.05  # auto leaves this share of the limit free, above its least KV

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
    context = reachable_context(
        config, layers=len(layers), batch=1, kv_budget=kv or KV_AUTO_MAX, kv_itemsize=kv_itemsize
    )
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


def stage_scratch(
    mb: ModelBytes, layers: range, max_chunk_tokens: int, max_compute_bytes: int, kv: int
) -> int:
    """A stage's whole scratch: its chunk's (``_scratch``) and its dense tiles'."""
    chunk = _scratch(
        mb.config, layers, mb.engine, max_chunk_tokens, max_compute_bytes, kv, _kv_itemsize(mb)
    )
    return chunk + _tile_scratch(mb, layers)


def footprint_of(
    mb: ModelBytes, layers: range, kv: int, max_chunk_tokens: int, max_compute_bytes: int
) -> StageFootprint:
    return StageFootprint(
        layers,
        mb.engine,
        mb.dtype,
        mb.form(layers),
        mb.weights(layers),
        kv,
        stage_scratch(mb, layers, max_chunk_tokens, max_compute_bytes, kv),
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
    return footprint_of(mb, layers, kv_budget_bytes, max_chunk_tokens, max_compute_bytes)


def default_engine(model_path: str | Path) -> tuple[str, str]:
    """(engine, dtype) a node picks by default (``engines.choice``): torch keeping
    a GGUF file's quantized form when torch is installed, else numpy float32."""
    return choose_engine(model_path, "auto", "auto")


class MemoryShortfall(ValueError):
    """The stages need more memory than the limit: the message says what would fit."""


def least_need(stages: Sequence[StageFootprint], kv: int | None) -> int:
    """The bytes ``stages`` need in one process (one runtime), their KV
    ``kv`` each, or (None: ``auto``) the least auto budget: independent of
    any limit, so the figure a refusal names is the one that then fits."""
    per_stage = KV_AUTO_MIN if kv is None else kv
    beside = sum(s.weights + s.scratch for s in stages)
    return beside + len(stages) * per_stage + max(s.runtime for s in stages)

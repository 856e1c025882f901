"""Which kernel a quantized stage's prompt tiles take: timed at load (issue 39).

Machines differ — a CPU with AMX multiplies bfloat16 several times faster
than one with AVX-512 BF16 alone, and one without either has no bfloat16
GEMM worth the name (AVX2, Zen 4's sibling without AVX-512: 35x slower than
int4pack at 256 rows, 1.4 s a product; measured) — so a CPU without
``avx512_bf16`` or ``amx_bf16`` takes int4pack at once, and a quantized CPU
stage on one with them times both kernels on one
representative matrix (``_SHAPE``, random int4pack weights) at a few row
counts, in turns, and takes the dense tiles (``dense_tiles``) when they win
at ``DECIDE_ROWS`` rows — a prefill step at the default
``--max-batch-tokens`` — by ``MARGIN`` (the median of the turns' ratios).
The margin keeps a machine near parity on int4pack, and the choice steady
from one load to the next (replicas that fail over to each other must choose
alike: a chunk's bits depend on it; ``/info`` shows it). Once per process
and thread count; 0.2-0.6 s on 2 cores.

``MESHNET_QUANT_KERNEL`` forces the choice: ``int4pack`` or ``dense``
(``auto``, the default, calibrates) — for tests, bisecting, and pinning
replicas on machines that would choose otherwise.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...formats.gguf.blocks import GROUP
from .dense_tiles import TILE_ROWS, DenseTiles
from .qlinear import int4pack_block, pack_int4

__all__ = ["CHOICES", "DECIDE_ROWS", "ENV", "MARGIN", "KernelChoice", "choose_kernels"]

ENV = "MESHNET_QUANT_KERNEL"
CHOICES = ("auto", "int4pack", "dense")
ROWS = (TILE_ROWS, 2 * TILE_ROWS, 4 * TILE_ROWS)
DECIDE_ROWS = 4 * TILE_ROWS
MARGIN = 0.8  # dense must take at most this share of int4pack's time
_SHAPE = (2048, 2048)  # [out, in]: a 1B model's o projection
_REPEATS = 5


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The stage's choice and what it rests on (``describe``: ``/info``)."""

    dense: bool
    chosen_by: str  # "calibration" or "MESHNET_QUANT_KERNEL=..."
    cpu: str
    calibration: Mapping[str, Any] | None = None
    block: int = 64  # int4pack's rows per block here (``qlinear.int4pack_block``)

    def dense_tiles(self) -> DenseTiles | None:
        """The stage's dense-tile kernel, or None when its prompt tiles take int4pack."""
        return DenseTiles(self.block) if self.dense else None

    def describe(self) -> dict[str, Any]:
        """``"kernels"`` of the stage's ``/info``."""
        out: dict[str, Any] = {
            "prompt_tiles": "dense" if self.dense else "int4pack",
            "tile_rows": TILE_ROWS,
            "chosen_by": self.chosen_by,
            "cpu": self.cpu,
        }
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out


def choose_kernels(torch: Any, environ: Mapping[str, str] | None = None) -> KernelChoice:
    """The kernel choice for a quantized CPU stage loading now, with the
    thread count this thread computes with. Raises ``ValueError`` (one line)
    for a bad ``MESHNET_QUANT_KERNEL``."""
    env = os.environ if environ is None else environ
    forced = env.get(ENV, "auto").strip().lower() or "auto"
    if forced not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {forced!r}")
    cpu = cpu_features(torch)
    block = int4pack_block(torch)
    if block is None:
        # No layout known to the decoder: int4pack it is, forced or not.
        return KernelChoice(False, "int4pack layout unknown to the dense tiles", cpu)
    if forced != "auto":
        return KernelChoice(forced == "dense", f"{ENV}={forced}", cpu, block=block)
    if not bfloat16_units(cpu):
        # Timing it would cost seconds at every start to learn what this says.
        return KernelChoice(False, "cpu: no bfloat16 GEMM units", cpu, block=block)
    figures = _calibrate(torch, torch.get_num_threads(), block)
    at = figures["rows"].index(DECIDE_ROWS)
    dense = figures["dense_over_int4pack"][at] <= MARGIN
    return KernelChoice(dense, "calibration", cpu, figures, block)


def cpu_features(torch: Any) -> str:
    """What the dense GEMM can use here: ``"avx512_bf16, no amx"`` and the like."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            line = next((x for x in info if x.startswith("flags")), "")
        flags = set(line.partition(":")[2].split())
    except OSError:
        pass
    isa = str(torch.backends.cpu.get_cpu_capability()).lower()
    if "avx512_bf16" in flags:
        isa = "avx512_bf16"
    if not flags:
        return f"{isa}, amx unknown"
    return f"{isa}, {'amx' if 'amx_bf16' in flags else 'no amx'}"


def bfloat16_units(cpu: str) -> bool:
    """Whether ``cpu`` (``cpu_features``) names units that multiply bfloat16
    (AVX-512 BF16 or AMX), or its flags are unknown (then calibration tells)."""
    return cpu.startswith("avx512_bf16") or cpu.endswith((", amx", "amx unknown"))


@functools.lru_cache(maxsize=8)
def _calibrate(
    torch: Any, threads: int, block: int, shape: tuple[int, int] = _SHAPE
) -> dict[str, Any]:
    """Both kernels at each of ``ROWS`` on ``shape``, ``_REPEATS`` times in
    turns: the best of each, and the median of the turns' ratios (dense over
    int4pack), which the choice reads (other processes on the cores disturb
    single timings by 2x here; measured)."""
    rng = np.random.default_rng(39)
    out, cols = shape
    nibbles = rng.integers(0, 16, (out, cols), dtype=np.uint8)
    packed = torch.from_numpy(pack_int4(nibbles, block))
    pairs = torch.from_numpy(rng.random((cols // GROUP, out, 2), dtype=np.float32) * 0.01)
    parts = ((packed, pairs.to(torch.bfloat16)),)
    kernel = DenseTiles(block)

    def int4pack(x: Any) -> Any:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, parts[0][1])

    def dense(x: Any) -> Any:
        tiles = [(lo, lo + TILE_ROWS) for lo in range(0, x.shape[0], TILE_ROWS)]
        return kernel.matmul(torch, x, parts, tiles, int4pack=int4pack)

    figures: dict[str, Any] = {"shape": list(shape), "threads": threads, "rows": list(ROWS)}
    timings: list[tuple[float, float, float]] = []
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32))
            x = x.to(torch.bfloat16)
            timings.append(_in_turns(lambda x=x: int4pack(x), lambda x=x: dense(x)))
    figures["int4pack_ms"] = [round(a * 1e3, 3) for a, _, _ in timings]
    figures["dense_ms"] = [round(b * 1e3, 3) for _, b, _ in timings]
    figures["dense_over_int4pack"] = [round(ratio, 3) for _, _, ratio in timings]
    wins = [rows for rows, (_, _, ratio) in zip(ROWS, timings, strict=True) if ratio < 1]
    figures["crossover_rows"] = wins[0] if wins else None
    return figures


def _in_turns(first: Any, second: Any) -> tuple[float, float, float]:
    """Seconds: each one's best of ``_REPEATS`` after a warm-up, taken in
    turns, and the median ratio ``second / first`` of the turns."""
    first(), second()
    best = [float("inf"), float("inf")]
    ratios = []
    for turn in range(_REPEATS):
        took = [0.0, 0.0]
        for i in (0, 1) if turn % 2 == 0 else (1, 0):
            started = time.perf_counter()
            (first, second)[i]()
            took[i] = time.perf_counter() - started
            best[i] = min(best[i], took[i])
        ratios.append(took[1] / took[0])
    return best[0], best[1], statistics.median(ratios)

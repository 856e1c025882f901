"""The compute section's figures: what each compares, its keys, its table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from . import _llama_cpp as llama
from ._result import SectionResult
from ._support import median

__all__ = ["FIGURES", "KEYS", "Samples", "report", "targets"]


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    label: str
    against: str  # the baseline's name
    measured: str  # the samples of the numerator
    baseline: str  # the samples of the denominator
    quoted: str | None = None  # llama.cpp's: the figure when not measured


FIGURES: tuple[Figure, ...] = (
    Figure(
        "prefill",
        "1B-shaped Q4_0 prefill pp512 tok/s, 1 stage",
        "llama-bench pp512",
        "prefill",
        "prefill_llama",
        "prefill_tok_s",
    ),
    Figure(
        "decode",
        "SmolLM2 decode tok/s, 1 stage, 1 stream",
        "llama-bench tg",
        "decode",
        "decode_llama",
        "decode_tok_s",
    ),
    Figure(
        "streams16",
        "SmolLM2 16 streams, aggregate tok/s",
        "llama-server -np 16",
        "streams16",
        "streams16_llama",
        "streams16_tok_s",
    ),
    Figure(
        "scaling16",
        "SmolLM2 16 streams / 1 stream, aggregate",
        "meshnet 1 stream",
        "streams16",
        "streams1",
    ),
    Figure(
        "stages2",
        "SmolLM2 decode tok/s, --stages 2 / --stages 1",
        "--stages 1",
        "stages2",
        "decode",
    ),
    Figure("bf16", "bf16 safetensors 16 sessions / 1, aggregate", "1 session", "bf16_16", "bf16_1"),
    Figure(
        "ready",
        "1B ready s (weights cache warm)",
        "llama-server /health",
        "ready",
        "ready_llama",
        "ready_s",
    ),
    Figure("busy", "decode beside 2 busy loops / quiet", "quiet decode", "busy", "decode"),
)
KEYS: tuple[str, ...] = (
    *(f"compute_{f.name}_{side}" for f in FIGURES for side in ("meshnet", "baseline", "ratio")),
    "compute_llama_busy_over_quiet",
    "compute_ready_cold",
    "compute_amx",
    "compute_llama_cpp",
    "compute_errors",
    "compute_load_average",
)


def targets(amx: bool) -> dict[str, tuple[str, float]]:
    """Issue 39's acceptance, on each figure's ratio (the prefill's by the CPU)."""
    return {
        "prefill": (">=", 1.5 if amx else 1.0),
        "decode": (">=", 0.9),
        "streams16": (">=", 1.0),
        "scaling16": (">=", 6.0),
        "stages2": (">=", 0.95),
        "bf16": (">=", 4.0),
        "ready": ("<=", 3.0),
        "busy": (">=", 0.35),
    }


@dataclass(slots=True)
class Samples:
    """Each contender's figure per round (tok/s or seconds); reported as medians."""

    values: dict[str, list[float]]
    errors: Counter[str]

    def add(self, name: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        found = self.values.get(name)
        return median(found) if found else None


@dataclass(frozen=True, slots=True)
class Context:
    amx: bool
    measured: bool  # llama.cpp ran here (else its figures are the issue's)
    found: str  # where llama.cpp was found, or why not
    rounds: int
    cores: list[int]
    seconds: float


def _judge(value: float | None, target: tuple[str, float]) -> str:
    if value is None:
        return "n/a"
    op, bound = target
    return "met" if (value >= bound if op == ">=" else value <= bound) else "not met"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def report(samples: Samples, context: Context) -> SectionResult:
    goals = targets(context.amx)
    result = SectionResult(
        title="Compute: meshnet beside llama.cpp, the same files on the same 2 cores"
    )
    keys: dict[str, float | int | str | None] = dict.fromkeys(KEYS)
    for figure in FIGURES:
        mine, theirs = samples.median(figure.measured), samples.median(figure.baseline)
        quoted = figure.quoted is not None and not context.measured
        if quoted:
            assert figure.quoted is not None
            theirs = llama.QUOTED[figure.quoted]
        ratio = round(mine / theirs, 3) if mine is not None and theirs else None
        rounds = _rounds(samples, figure, theirs if quoted else None)
        keys[f"compute_{figure.name}_meshnet"] = None if mine is None else round(mine, 3)
        keys[f"compute_{figure.name}_baseline"] = None if theirs is None else round(theirs, 3)
        keys[f"compute_{figure.name}_ratio"] = ratio
        op, bound = goals[figure.name]
        result.rows.append(
            {
                "figure": figure.label,
                "meshnet": _number(mine),
                "baseline": f"{_number(theirs)} ({figure.against}{', quoted' if quoted else ''})",
                "ratio": "-" if ratio is None else f"{ratio:.2f}x",
                "each round": rounds,
                "target": f"{op} {bound}",
                "": _judge(ratio, goals[figure.name]),
            }
        )
    busy, quiet = samples.median("llama_busy"), samples.median("decode_llama")
    if busy is not None and quiet:
        keys["compute_llama_busy_over_quiet"] = round(busy / quiet, 3)
    cold = samples.median("ready_cold")
    keys["compute_ready_cold"] = None if cold is None else round(cold, 3)
    keys["compute_amx"] = int(context.amx)
    keys["compute_llama_cpp"] = "measured" if context.measured else "quoted"
    keys["compute_errors"] = ",".join(f"{k}:{v}" for k, v in sorted(samples.errors.items())) or "0"
    loads = samples.values.get("load") or [0.0]
    keys["compute_load_average"] = round(max(loads), 2)
    result.keys = keys
    result.notes += _notes(context, keys, (min(loads), max(loads)))
    return result


def _rounds(samples: Samples, figure: Figure, quoted: float | None) -> str:
    """Each round's ratio (the sides' samples pair up round by round)."""
    mine = samples.values.get(figure.measured, [])
    theirs = [quoted] * len(mine) if quoted else samples.values.get(figure.baseline, [])
    if len(mine) != len(theirs) or len(mine) < 2:
        return ""
    return " ".join(f"{a / b:.2f}" for a, b in zip(mine, theirs, strict=True))


def _notes(context: Context, keys: Mapping[str, object], load: tuple[float, float]) -> list[str]:
    amx = "has AMX (amx_tile)" if context.amx else "has no AMX (no amx_tile in /proc/cpuinfo)"
    where = (
        f"llama.cpp measured here ({context.found})"
        if context.measured
        else f"llama.cpp not run ({context.found}): its figures are quoted from a run on "
        "this machine kind"
    )
    notes = [
        f"This CPU {amx}: the prefill target is {targets(context.amx)['prefill'][1]}x. {where}.",
        f"Medians of {context.rounds} interleaved round(s); every process pinned to cores "
        f"{context.cores}, llama.cpp -t {llama.THREADS}, meshnet at its defaults there; "
        f"speculation off.",
        f"Errors: {keys['compute_errors']}; load average {load[0]:.1f}-{load[1]:.1f} over "
        f"the section (1 min, at each step) on {_cpus()} CPUs; it took "
        f"{context.seconds:.0f} s. Read the ratios, not the absolutes.",
    ]
    cold, theirs = keys["compute_ready_cold"], keys["compute_ready_baseline"]
    if isinstance(cold, float):
        against = f" ({cold / theirs:.2f}x)" if isinstance(theirs, float) and theirs else ""
        notes.append(f"1B ready with the weights cache cold (a first start): {cold} s{against}")
    if keys["compute_llama_busy_over_quiet"] is not None:
        ratio = keys["compute_llama_busy_over_quiet"]
        notes.append(
            f"llama-bench tg beside the same 2 busy loops / quiet: {ratio}x "
            "(a reference, no target)"
        )
    return notes


def _cpus() -> int:
    import os

    return os.cpu_count() or 1

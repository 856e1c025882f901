"""``meshnet bench``: run the sections, print one table (or one JSON object).

A section is a module of this package with ``run(options) -> SectionResult``
(see :mod:`meshnet_bench._result`). :data:`SECTIONS` names them in the order
they run; adding a comparison is adding its module name there. A module may
also declare ``KEYS`` (the JSON keys it owns) so that, should it fail, the
JSON object still carries those keys (as ``null``) and says which failed.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ._result import BenchOptions, SectionResult

__all__ = ["SECTIONS", "TARGETS", "main", "run_sections"]

# Module names under meshnet_bench, in running order. Sections are
# independent: each starts and stops its own servers.
SECTIONS: tuple[str, ...] = (
    "wire",
    "hop",
    "decode",
    "pipeline",
    "codec",
    "memory",
    "concurrency",
    "model",
    "failover",
    "engines",
    "quant",
    "serve",
    "identity",
    "prefix",
    "pd",
    "link",
    "tenants",
    "spec",
    "compute",  # issue 39: beside llama.cpp where one is found (its own targets)
)

# key -> (comparison, bound): the floors. Printed next to the figures.
TARGETS: dict[str, tuple[str, float]] = {
    "wire1_over_wire2_time": (">=", 6),
    "wire2_over_wire1_bytes": ("<=", 0.30),
    "hop_over_raw_throughput": (">=", 0.6),
    "decode_over_bare_h11_p50": ("<=", 1.3),  # issue 21 (it was 1.5)
    "pipeline_efficiency": (">=", 0.85),
    "relay_rss_over_payload": ("<=", 3),
    "prefix_second_turn_ttft_over_cold": ("<=", 0.35),
    "pd_decode_p99_over_mixed": ("<=", 0.5),
    # issue 36: the real model over two stages on the wifi profile
    "link_wifi_decode_speedup": (">=", 2.0),
    # issue 37: another tenant's right guess costs what a wrong one does
    "tenants_apart_right_over_wrong": (">=", 0.8),
    "link_wifi_bytes_up_per_token_hop": ("<=", 1024),
    "link_wifi_ms_over_floor": ("<=", 1.3),
    "link_loopback_decode_ratio": (">=", 0.95),
    # issue 38: speculative decoding, the real model over two stages
    "spec_wifi_draftable_speedup": (">=", 2.5),
    "spec_wifi_prose_ratio": (">=", 0.95),
    "spec_loopback_draftable_ratio": (">=", 1.0),
    "spec_loopback_prose_ratio": (">=", 0.95),
}

# In the current directory: the committed docs/bench-throughput.png is only
# replaced when asked for by name (--plot docs/bench-throughput.png).
DEFAULT_PLOT = Path("bench-throughput.png")
# What --quick promises (on an idle machine; a loaded one is told it ran over).
QUICK_BUDGET_S = 60.0
# Exit status when every section ran but a figure missed its target.
EXIT_TARGET_MISSED = 3


def load_section(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def run_sections(
    options: BenchOptions, names: Sequence[str] = SECTIONS
) -> tuple[list[SectionResult], dict[str, Any]]:
    """Every section in turn; a failing one is reported and the rest still run.

    Returns the results and the merged flat key object (a failed section's
    declared ``KEYS`` are ``None`` and its name is listed under ``"failed"``).
    """
    results: list[SectionResult] = []
    keys: dict[str, Any] = {}
    failed: list[str] = []
    for name in names:
        module = load_section(name)
        started = time.perf_counter()
        try:
            result = module.run(options)
        except Exception as exc:
            failed.append(name)
            options.progress(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            options.progress(traceback.format_exc().rstrip())
            result = SectionResult(title=f"{name}: FAILED ({type(exc).__name__}: {exc})")
            result.keys = dict.fromkeys(getattr(module, "KEYS", ()))
        options.progress(f"{name}: done in {time.perf_counter() - started:.1f} s")
        results.append(result)
        keys.update(result.keys)
    if failed:
        keys["failed"] = ",".join(failed)
    return results, keys


# ------------------------------------------------------------ the table


def _grid(rows: list[dict[str, str]]) -> list[str]:
    """Rows (column -> cell) as aligned text; first column left, the rest right."""
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(row.get(c, "")) for row in rows)) for c in columns}

    def line(cells: dict[str, str]) -> str:
        out = [
            cells.get(c, "").ljust(widths[c]) if i == 0 else cells.get(c, "").rjust(widths[c])
            for i, c in enumerate(columns)
        ]
        return "  " + "  ".join(out).rstrip()

    return [line({c: c for c in columns}), "  " + "  ".join("-" * widths[c] for c in columns),
            *(line(row) for row in rows)]  # fmt: skip


def verdict(key: str, value: Any) -> str:
    if key not in TARGETS:
        return ""
    op, bound = TARGETS[key]
    if not isinstance(value, (int, float)):
        return "n/a"
    ok = value >= bound if op == ">=" else value <= bound
    return "ok" if ok else "MISS"


def missed_targets(keys: dict[str, Any]) -> list[str]:
    """``key value (target op bound)`` for each target missed or not measured."""
    return [
        f"{key} {keys.get(key)} (target {op} {bound})"
        for key, (op, bound) in TARGETS.items()
        if key in keys and verdict(key, keys[key]) != "ok"
    ]


def render(results: list[SectionResult], keys: dict[str, Any], header: str) -> str:
    lines = [header, ""]
    for result in results:
        lines.append(result.title)
        if result.rows:
            lines += _grid(result.rows)
        lines += [f"  {note}" for note in result.notes]
        lines.append("")
    summary = [
        {
            "key": key,
            "value": str(value),
            "target": " ".join(map(str, TARGETS[key])) if key in TARGETS else "",
            "": verdict(key, value),
        }
        for key, value in keys.items()
    ]
    lines.append("summary (the keys of --json)")
    lines += _grid(summary)
    return "\n".join(lines)


def machine_line(options: BenchOptions) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    mode = "tiny" if options.tiny else "quick" if options.quick else "full"
    return (
        f"meshnet bench ({mode}): Python {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load} at start, {options.async_backend}"
    )


# ------------------------------------------------------------ the chart


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw_plot(options: BenchOptions, path: Path) -> Path:
    """End-to-end throughput against payload size, wire 1 and wire 2, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import wire

    points = wire.sweep(options)
    figure, axes = plt.subplots(figsize=(8, 5), dpi=110)
    for name in dict.fromkeys(p.name for p in points):
        mine = [p for p in points if p.name == name]
        axes.plot([p.tensor_bytes / 2**20 for p in mine], [p.mb_s for p in mine],
                  marker="o", label=name)  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("activation size, float32 MiB ([1, tokens, 4096])")
    axes.set_ylabel("end-to-end throughput, float32 MB/s")
    axes.set_title("client -> gateway -> 2 echo nodes -> back (one process, loopback)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


# ------------------------------------------------------------ the command


def main(
    *,
    quick: bool = False,
    tiny: bool = False,
    as_json: bool = False,
    plot: Path | None = None,
    only: Sequence[str] | None = None,
    async_backend: str = "trio",
    out: Callable[[str], None] = print,
) -> int:
    """What ``meshnet bench`` runs. Exit status: 0 when every section ran and
    every target measured was met; 1 when a section failed; 2 for --plot
    without matplotlib; 3 when a target was missed (named on stderr). At
    ``tiny`` sizes targets are not judged: the figures mean nothing there."""
    if plot is not None and not plot_available():
        print(
            "meshnet bench --plot needs matplotlib, which is not installed: "
            "pip install -e '.[bench]' in the meshnet checkout (or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    options = BenchOptions(quick=quick, tiny=tiny, async_backend=async_backend)
    header = machine_line(options)
    options.progress(header)
    started = time.perf_counter()
    results, keys = run_sections(options, only or SECTIONS)
    if plot is not None:
        options.progress(f"plot: written to {draw_plot(options, plot)}")
    elapsed = time.perf_counter() - started
    options.progress(f"bench done in {elapsed:.1f} s")
    if quick and elapsed > QUICK_BUDGET_S:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        options.progress(f"note: --quick took {elapsed:.0f} s, over its {QUICK_BUDGET_S:.0f} s "
                         f"budget (an idle machine's); load average now {load}")  # fmt: skip
    if as_json:
        out(json.dumps(keys))
    else:
        out(render(results, keys, header))
    if "failed" in keys:
        return 1
    missed = [] if tiny else missed_targets(keys)
    for line in missed:
        options.progress(f"target missed: {line}")
    return EXIT_TARGET_MISSED if missed else 0

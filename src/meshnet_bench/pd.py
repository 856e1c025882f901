"""``meshnet bench`` section: prefill/decode disaggregation (wire-2 §3.12).

A random checkpoint of SmolLM-135M's shape, served whole by two node
processes, each pinned to its own core (``sched_setaffinity``, what
``taskset`` does; ``--threads 1``) to stand in for two machines. This
process holds a replica set over the two (the gateway's entry hop, as
``--entry a,b`` builds it) and drives it with the gateway's own generation
code (``ChainSession``).

The workload, the same in both modes: a few streams decode greedily (a short
prompt, then token after token; a stream that reaches its length starts
again with a new prompt) while long prompts arrive one after another, each
answered with a couple of tokens. The per-token latency of the streams (the
wall time of each decode step) is recorded from the first long prompt's
arrival to the last one's answer.

* **mixed** — both replicas ``--kv-role any``: the streams are spread over
  both, and a long prompt's chunks compute on a replica between its streams'
  decode steps (a float stage does not split a chunk).
* **disaggregated** — ``--kv-role prefill`` and ``--kv-role decode``: every
  prompt runs on the prefill replica, and the session moves by its KV to the
  decode replica before its first decode step (the move is timed inside
  that step: it is counted as a decode step's latency, not hidden).

The answers must be equal: the long prompts' tokens and a probe's (a fixed
prompt run alone after the workload), greedy, in both modes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field

import anyio
import numpy as np

from meshnet_bench._greedy import greedy
from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import QUIET, percentile, server_process
from meshnet_gateway.openai.generation import ChainSettings
from meshnet_model.testing import small_config, smollm_135m_config, write_checkpoint
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.replicas import ReplicaSet

__all__ = ["run"]

KEYS = (
    "pd_decode_p50_mixed_ms",
    "pd_decode_p99_mixed_ms",
    "pd_decode_p50_disaggregated_ms",
    "pd_decode_p99_disaggregated_ms",
    "pd_decode_p99_over_mixed",
    "pd_long_ttft_over_mixed",
    "pd_answers_equal",
    "pd_handoffs",
)
MODES = {"mixed": ("any", "any"), "disaggregated": ("prefill", "decode")}


@dataclass(frozen=True, slots=True)
class _Workload:
    layers: int
    streams: int
    stream_prompt: int
    stream_steps: int
    long_prompts: int
    long_tokens: int
    long_answer: int
    probe_answer: int
    label: str


def _workload(options: BenchOptions) -> _Workload:
    if options.tiny:
        return _Workload(
            layers=2,
            streams=2,
            stream_prompt=8,
            stream_steps=6,
            long_prompts=1,
            long_tokens=300,
            long_answer=2,
            probe_answer=3,
            label="toy 2-layer model",
        )
    if options.quick:
        return _Workload(
            layers=8,
            streams=4,
            stream_prompt=32,
            stream_steps=32,
            long_prompts=1,
            long_tokens=1500,
            long_answer=2,
            probe_answer=4,
            label="SmolLM-135M shape, 8 layers",
        )
    return _Workload(
        layers=30,
        streams=4,
        stream_prompt=32,
        stream_steps=64,
        long_prompts=3,
        long_tokens=1500,
        long_answer=2,
        probe_answer=8,
        label="SmolLM-135M shape, 30 layers",
    )


@dataclass(slots=True)
class _Mode:
    token_times: list[float] = field(default_factory=list)  # seconds per decode step
    long_ttft: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)  # long prompts', then the probe's
    handoffs: int = 0
    replayed: int = 0


SETTINGS = ChainSettings(
    chunk_tokens=128, inflight=1, encoding="identity", zstd_level=3, timeout=600.0
)


def _ids(vocab: int, seed: Sequence[int], count: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(list(seed)).integers(0, vocab, count)]


async def _drive(urls: list[str], plan: _Workload, vocab: int) -> _Mode:
    mode = _Mode()
    codecs = CodecPool()
    # The gateway's entry hop over two replicas, as `meshnet_gateway --entry a,b`
    # builds it (its probes read each replica's role: wire-2 §3.12).
    pool = ReplicaSet([parse_endpoint(url) for url in urls], health_interval=0.5)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(pool.aclose)
        monitor = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(monitor.cancel_scope.cancel)
        monitor.start_soon(pool.maintain)
        with anyio.fail_after(120):  # registration: identities and roles read
            while not all(r.identity_read for r in pool.replicas):
                await anyio.sleep(0.05)
        await greedy(pool, codecs, SETTINGS, _ids(vocab, [9], 16), 3)  # warm-up
        recording, done = anyio.Event(), anyio.Event()
        started_streams = [0]

        def record(seconds: float) -> None:
            if recording.is_set() and not done.is_set():
                mode.token_times.append(seconds)

        async def stream(index: int) -> None:
            for restart in range(10_000):  # bounded; ends when the long prompts are done
                if done.is_set():
                    return
                started_streams[0] += restart == 0
                ids = _ids(vocab, [1, index, restart], plan.stream_prompt)
                await greedy(pool, codecs, SETTINGS, ids, plan.stream_steps, record)

        async def long_prompts() -> None:
            with anyio.fail_after(120):  # every stream decoding before the first arrives
                while started_streams[0] < plan.streams:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            recording.set()
            for k in range(plan.long_prompts):
                ids = _ids(vocab, [2, k], plan.long_tokens)
                answered = await greedy(pool, codecs, SETTINGS, ids, plan.long_answer, record)
                mode.long_ttft.append(answered.ttft)
                mode.answers.append(answered.tokens)
            done.set()

        async with anyio.create_task_group() as tasks:
            for index in range(plan.streams):
                tasks.start_soon(stream, index)
            tasks.start_soon(long_prompts)
        probe = await greedy(pool, codecs, SETTINGS, _ids(vocab, [3], 48), plan.probe_answer)
        mode.answers.append(probe.tokens)
        mode.handoffs = pool.failover.handoffs.moved
        mode.replayed = pool.failover.replayed_chunks
    return mode


def _cores() -> tuple[int, int]:
    """Two distinct cores this process may use (one twice on a one-core box)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], allowed[-1]


def _pinned(core: int) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, {core})


def _replicas(stack: ExitStack, checkpoint: str, roles: tuple[str, str]) -> Iterator[str]:
    for role, core in zip(roles, _cores(), strict=True):
        flags = [*QUIET, "--model", checkpoint, "--threads", "1", "--kv-role", role]
        _, url = stack.enter_context(
            server_process("meshnet_node", *flags, timeout=300.0, preexec_fn=_pinned(core))
        )
        yield url


def _measure(
    checkpoint: str, plan: _Workload, vocab: int, options: BenchOptions
) -> dict[str, _Mode]:
    figures = {}
    for name, roles in MODES.items():
        options.progress(
            f"pd: {name} (--kv-role {','.join(roles)}), {plan.streams} streams, "
            f"{plan.long_prompts} x {plan.long_tokens}-token prompts"
        )
        with ExitStack() as stack:
            urls = list(_replicas(stack, checkpoint, roles))
            figures[name] = anyio.run(_drive, urls, plan, vocab, backend=options.async_backend)
    return figures


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


def run(options: BenchOptions) -> SectionResult:
    plan = _workload(options)
    config = (
        small_config(num_hidden_layers=plan.layers, max_position_embeddings=512)
        if options.tiny
        else smollm_135m_config(num_hidden_layers=plan.layers)
    )
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-pd-") as directory:
        options.progress(f"pd: writing a random checkpoint ({plan.label})")
        write_checkpoint(directory, config, seed=0)
        got = _measure(directory, plan, config.vocab_size, options)
    mixed, split = got["mixed"], got["disaggregated"]
    equal = mixed.answers == split.answers
    if not equal:
        raise RuntimeError("pd: the answers with and without disaggregation differ")
    p = {
        name: (percentile(m.token_times, 0.5), percentile(m.token_times, 0.99))
        for name, m in got.items()
    }
    ttft = {name: percentile(m.long_ttft, 0.5) for name, m in got.items()}
    result = SectionResult(
        title=f"Prefill/decode disaggregation: 2 replicas of the whole model ({plan.label}), "
        f"a core each; {plan.streams} streams decoding while {plan.long_prompts} "
        f"{plan.long_tokens}-token prompts arrive"
    )
    result.keys = {
        "pd_decode_p50_mixed_ms": _ms(p["mixed"][0]),
        "pd_decode_p99_mixed_ms": _ms(p["mixed"][1]),
        "pd_decode_p50_disaggregated_ms": _ms(p["disaggregated"][0]),
        "pd_decode_p99_disaggregated_ms": _ms(p["disaggregated"][1]),
        "pd_decode_p99_over_mixed": round(p["disaggregated"][1] / p["mixed"][1], 3),
        "pd_long_ttft_over_mixed": round(ttft["disaggregated"] / ttft["mixed"], 3),
        "pd_answers_equal": int(equal),
        "pd_handoffs": split.handoffs,
    }
    for name, m in got.items():
        result.rows.append(
            {
                "mode": f"{name} (--kv-role {','.join(MODES[name])})",
                "decode steps": str(len(m.token_times)),
                "per-token p50": f"{1000 * p[name][0]:.1f} ms",
                "per-token p99": f"{1000 * p[name][1]:.1f} ms",
                "p99 vs mixed": f"{p[name][1] / p['mixed'][1]:.2f}",
                "long-prompt TTFT p50": f"{1000 * ttft[name]:.0f} ms",
                "KV moves": str(m.handoffs),
                "replayed chunks": str(m.replayed),
            }
        )
    result.notes.append(
        "Greedy answers (long prompts and a probe) equal in both modes: yes; the KV move is "
        "timed inside the first decode step of each session."
    )
    return result

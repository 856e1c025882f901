"""``meshnet bench`` section: a real model's layers split over 1, 2 and 3 nodes.

A random checkpoint of SmolLM-135M's shape (hidden 576, 9 heads / 3 KV heads,
intermediate 1536, vocabulary 49152, tied head; 30 layers, 4 in quick mode,
a 4-layer toy in tiny mode) is written to a temporary directory, then served
by in-process nodes over loopback TCP: one node with every layer, then the
layers split evenly over two and over three nodes, all up at once in the
same run and measured step by step in turn (chunk k on 1, 2, 3 nodes, then
chunk k+1 …; decode step j on each), so load changes hit them alike.

Per chain: prefill tokens/s (a prompt in chunks, one session) and decode
tokens/s (one-token runs on the same session, as a generator does). The
ratios ``split/single`` say what splitting costs on one machine, where it can
only cost: the layers' compute is the same and every hop adds a wire round
trip. ``model_split{2,3}_pipelined_prefill_over_single`` sends the prompt with one
chunk in flight per node (node k on chunk i+1 while chunk i is further down),
against the single node's prefill — what chunked prefill is for; on one
machine the nodes share its cores, across machines they do not.
``model_decode_wire_share`` is the share of a decode step's wall time
not spent inside the stages' layers (HTTP, codec, sequencing, thread hops)
on the 2-node split — what the wire costs where it matters most.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import numpy as np

from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_model.testing import small_config, smollm_135m_config, write_checkpoint
from meshnet_node.model_chain import ModelSession, even_splits, start_model_chain
from meshnet_node.model_stage import ModelStage
from meshnet_runtime.downstream import DownstreamPool

__all__ = ["run"]

KEYS = (
    "model_split2_over_single_prefill",
    "model_split2_over_single_decode",
    "model_split3_over_single_prefill",
    "model_split3_over_single_decode",
    "model_split2_pipelined_prefill_over_single",
    "model_split3_pipelined_prefill_over_single",
    "model_decode_wire_share",
    "model_split3_decode_wire_share",
    "model_single_prefill_tokens_per_s",
    "model_single_decode_tokens_per_s",
    "model_splits_bit_identical",
)


@dataclass(frozen=True, slots=True)
class _Plan:
    layers: int
    prompt: int
    chunk: int
    decode: int
    repeats: int
    label: str


@dataclass(frozen=True, slots=True)
class _Measured:
    nodes: int
    prefill_tps: float
    pipelined_prefill_tps: float
    decode_tps: float
    decode_wire_share: float


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan(layers=4, prompt=16, chunk=8, decode=3, repeats=1, label="toy 4-layer model")
    if options.quick:
        return _Plan(
            layers=4, prompt=32, chunk=16, decode=6, repeats=1, label="SmolLM-135M shape, 4 layers"
        )
    return _Plan(
        layers=30, prompt=128, chunk=32, decode=16, repeats=2, label="SmolLM-135M shape, 30 layers"
    )


@dataclass(slots=True)
class _Chain:
    pool: DownstreamPool
    stages: list[ModelStage]
    prefill: float = 0.0  # seconds, all repeats
    pipelined: float = 0.0  # prefill with one chunk in flight per node
    decode: float = 0.0
    decode_compute: float = 0.0  # seconds inside the layers during decode

    def compute(self) -> float:
        return sum(s.compute_seconds for s in self.stages)


async def _measure_all(
    directory: str, plan: _Plan, vocab: int, progress: Callable[[str], None]
) -> tuple[dict[int, _Measured], bool]:
    """All three chains up at once and measured step by step in turn — chunk k
    of the prompt on 1, 2, 3 nodes, then chunk k+1 …, decode step j on each —
    so a change in the machine's load hits all of them alike. Returns the
    figures and whether every chain's logits were bit-identical."""
    ids = np.random.default_rng(0).integers(0, vocab, (1, plan.prompt)).astype(np.int32)
    bounds = list(range(0, plan.prompt, plan.chunk))
    identical = True
    async with AsyncExitStack() as stack:
        chains: dict[int, _Chain] = {}
        for n in (1, 2, 3):
            nodes = await stack.enter_async_context(
                start_model_chain(directory, even_splits(plan.layers, n))
            )
            pool = DownstreamPool(nodes[0].url)
            stack.push_async_callback(pool.aclose)
            stages = [node.app.stage for node in nodes]
            assert all(isinstance(s, ModelStage) for s in stages)
            chains[n] = _Chain(pool, stages)  # type: ignore[arg-type]
            # Warm-up: first touch of the mapped weights, worker threads started.
            warm = ModelSession(pool)
            await warm.run(ids[:, : plan.chunk])
            await warm.decode(0)
            await warm.delete()
        for repeat in range(plan.repeats):
            progress(f"model: 1, 2 and 3 nodes side by side, repeat {repeat + 1}/{plan.repeats}")
            sessions = {n: ModelSession(c.pool) for n, c in chains.items()}
            logits: dict[int, np.ndarray] = {}
            try:
                for index, lo in enumerate(bounds):
                    for n, chain in chains.items():
                        started = time.perf_counter()
                        logits[n] = await sessions[n].send(
                            ids[:, lo : lo + plan.chunk], index, len(bounds)
                        )
                        chain.prefill += time.perf_counter() - started
                for _ in range(plan.decode):
                    for n, chain in chains.items():
                        token = int(np.argmax(logits[n][0]))  # greedy, as a generator
                        before = chain.compute()
                        started = time.perf_counter()
                        logits[n] = await sessions[n].decode(token)
                        chain.decode += time.perf_counter() - started
                        chain.decode_compute += chain.compute() - before
                identical &= all(np.array_equal(logits[1], logits[n]) for n in (2, 3))
            finally:
                for session in sessions.values():
                    await session.delete()
            # Pipelined prefill: as many chunks in flight as the chain has nodes,
            # so node k works on chunk i+1 while chunk i is further down.
            for n, chain in chains.items():
                session = ModelSession(chain.pool)
                try:
                    started = time.perf_counter()
                    await session.run(ids, chunk_tokens=plan.chunk, inflight=n)
                    chain.pipelined += time.perf_counter() - started
                finally:
                    await session.delete()
    measured = {
        n: _Measured(
            nodes=n,
            prefill_tps=plan.prompt * plan.repeats / c.prefill,
            pipelined_prefill_tps=plan.prompt * plan.repeats / c.pipelined,
            decode_tps=plan.decode * plan.repeats / c.decode,
            decode_wire_share=max(0.0, 1.0 - c.decode_compute / c.decode),
        )
        for n, c in chains.items()
    }
    return measured, identical


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    config = (
        small_config(num_hidden_layers=plan.layers)
        if options.tiny
        else smollm_135m_config(num_hidden_layers=plan.layers)
    )
    result = SectionResult(title=f"Model stages split over nodes ({plan.label}, loopback)")
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-model-") as directory:
        options.progress(f"model: writing a random checkpoint ({plan.label})")
        write_checkpoint(directory, config, seed=0)
        measured, identical = anyio.run(
            _measure_all,
            directory,
            plan,
            config.vocab_size,
            options.progress,
            backend=options.async_backend,
        )
    single = measured[1]
    keys: dict[str, float | int | str | None] = {
        "model_shape": plan.label,
        "model_prompt_tokens": plan.prompt,
        "model_decode_steps": plan.decode,
        "model_single_prefill_tokens_per_s": round(single.prefill_tps, 2),
        "model_single_decode_tokens_per_s": round(single.decode_tps, 2),
    }
    for stages in (2, 3):
        m = measured[stages]
        keys[f"model_split{stages}_over_single_prefill"] = round(
            m.prefill_tps / single.prefill_tps, 3
        )
        keys[f"model_split{stages}_over_single_decode"] = round(m.decode_tps / single.decode_tps, 3)
        keys[f"model_split{stages}_pipelined_prefill_over_single"] = round(
            m.pipelined_prefill_tps / single.prefill_tps, 3
        )
    keys["model_decode_wire_share"] = round(measured[2].decode_wire_share, 3)
    # float32 wire: every split must give the very logits of one node (docs/models.md).
    keys["model_splits_bit_identical"] = int(identical)
    keys["model_split3_decode_wire_share"] = round(measured[3].decode_wire_share, 3)
    result.keys = keys
    for stages, m in measured.items():
        result.rows.append(
            {
                "nodes": str(stages),
                "prefill tok/s": f"{m.prefill_tps:.1f}",
                "decode tok/s": f"{m.decode_tps:.1f}",
                "prefill vs 1 node": f"{m.prefill_tps / single.prefill_tps:.2f}",
                "pipelined vs 1 node": f"{m.pipelined_prefill_tps / single.prefill_tps:.2f}",
                "decode vs 1 node": f"{m.decode_tps / single.decode_tps:.2f}",
                "decode time on the wire": f"{100 * m.decode_wire_share:.0f}%",
            }
        )
    result.notes.append(
        "All nodes share this machine's cores, so a split can only add wire time here; "
        "across machines each node has its own cores and memory."
    )
    result.notes.append(
        "'on the wire' = decode wall time not spent in the stages' layers "
        "(HTTP, codec, sequencing, thread hops)."
    )
    return result

"""``meshnet bench`` section: what a failover costs a generation (issue 14).

A random checkpoint (SmolLM-135M's layer shape, 4 layers; the 4-layer toy
in tiny mode) split over two stages, the second served by two replicas
behind the first node's ``--next r1,r2``, all in this process over loopback.
One session prefills a prompt and decodes greedily; the replica holding it
is then shut down (it answers ``503 shutting_down``, then is gone) and the
next step fails over: the first node replays the session's history (what it
had sent down) to the other replica, which rebuilds its KV cache, then the
step goes on. Decoding then continues; the ids must equal an uninterrupted
run's (one process, every layer).

Keys (ratios: the machine is shared, absolutes mean little):
``failover_recovery_over_step`` — the failed-over step's wall time ÷ the
median normal decode step; ``failover_extra_over_prefill`` — that step's
extra time (over a normal step) ÷ the original prefill of the same number
of tokens (scaled from the prompt's prefill): what the replay costs against
computing the history once; ``failover_replayed_tokens``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import AsyncExitStack

import anyio
import numpy as np

from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_model import StageRunner
from meshnet_model.testing import small_config, smollm_135m_config, write_checkpoint
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig
from meshnet_node.model_chain import ModelSession
from meshnet_runtime.downstream import DownstreamPool
from meshnet_runtime.replicas import ReplicaSet

__all__ = ["run"]

KEYS = ("failover_recovery_over_step", "failover_extra_over_prefill", "failover_replayed_tokens")
QUIET = ["--port", "0", "--log-level", "error"]


def _greedy(logits: np.ndarray) -> np.ndarray:
    return np.asarray([[int(np.argmax(logits[0]))]], dtype=np.int32)


async def _measure(checkpoint: str, prompt: np.ndarray, steps: int, chunk: int) -> dict[str, float]:
    async with AsyncExitStack() as stack:
        # What this section measures is a replay: the replica that goes keeps
        # no session for a KV hand-off (that would move it without one).
        model = ["--model", checkpoint, "--handoff-window", "0"]
        replicas = [
            await stack.enter_async_context(
                serve_node(NodeConfig.load([*QUIET, *model, "--layers", "2:4"], {}))
            )
            for _ in range(2)
        ]
        urls = ",".join(r.url for r in replicas)
        entry = await stack.enter_async_context(
            serve_node(NodeConfig.load([*QUIET, *model, "--layers", "0:2", "--next", urls], {}))
        )
        hop = entry.app.downstream
        assert isinstance(hop, ReplicaSet)
        pool = DownstreamPool(entry.url)
        stack.push_async_callback(pool.aclose)
        session = ModelSession(pool)
        started = time.perf_counter()
        logits = await session.run(prompt, chunk)
        prefill = time.perf_counter() - started
        ids: list[int] = []
        step_times: list[float] = []
        for _ in range(steps):
            token = _greedy(logits)
            ids.append(int(token[0, 0]))
            started = time.perf_counter()
            logits = await session.run(token)
            step_times.append(time.perf_counter() - started)
        holder = next(r for r in replicas if r.url == hop.holder(session.session))
        holder.server.request_shutdown()
        token = _greedy(logits)
        ids.append(int(token[0, 0]))
        started = time.perf_counter()
        logits = await session.run(token)
        recovery = time.perf_counter() - started
        for _ in range(3):  # it goes on after the failover
            token = _greedy(logits)
            ids.append(int(token[0, 0]))
            logits = await session.run(token)
        ids.append(int(_greedy(logits)[0, 0]))
        return {
            "prefill": prefill,
            "step": statistics.median(step_times),
            "recovery": recovery,
            "replayed": float(hop.replayed_tokens),
            "ids": ids,  # type: ignore[dict-item]
        }


def _reference(checkpoint: str, prompt: np.ndarray, count: int) -> list[int]:
    runner = StageRunner.load(checkpoint)
    logits = runner.run("r", 0, prompt)
    position, ids = prompt.shape[1], []
    for _ in range(count):
        ids.append(int(np.argmax(logits[0])))
        logits = runner.run("r", position, np.asarray([[ids[-1]]], dtype=np.int32))
        position += 1
    return ids


def run(options: BenchOptions) -> SectionResult:
    tiny = options.tiny
    config = small_config() if tiny else smollm_135m_config(num_hidden_layers=4)
    tokens, steps, chunk = (8, 3, 4) if tiny else (64, 16, 16)
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-failover-") as tmp:
        checkpoint = str(write_checkpoint(tmp, config, seed=4))
        prompt = np.random.default_rng(2).integers(3, config.vocab_size, (1, tokens))
        prompt = prompt.astype(np.int32)
        options.progress(f"failover: {tokens}-token prompt, {steps} steps, then the holder goes")
        got = anyio.run(_measure, checkpoint, prompt, steps, chunk, backend=options.async_backend)
        ids = got.pop("ids")
        exact = ids == _reference(checkpoint, prompt, len(ids))  # type: ignore[arg-type]
    if not exact:
        raise RuntimeError("failover: the greedy ids differ from an uninterrupted run")
    step, prefill, recovery = got["step"], got["prefill"], got["recovery"]
    history_prefill = prefill * got["replayed"] / tokens  # the history, computed once
    result = SectionResult(
        title=f"failover: 2 stages, stage 2 on 2 replicas; {tokens}-token prompt, "
        f"{steps} decode steps, then the holding replica shuts down",
        keys={
            "failover_recovery_over_step": round(recovery / step, 2),
            "failover_extra_over_prefill": round((recovery - step) / history_prefill, 2),
            "failover_replayed_tokens": int(got["replayed"]),
        },
    )
    result.rows.append(
        {
            "normal step": f"{step * 1000:.1f} ms",
            "failed-over step": f"{recovery * 1000:.1f} ms",
            "prompt prefill": f"{prefill * 1000:.1f} ms",
            "replayed tokens": str(int(got["replayed"])),
        }
    )
    result.notes.append("greedy ids after the failover equal an uninterrupted run's (checked)")
    return result

"""``meshnet bench`` section: the chain's prefix cache (wire-2 §3.10).

A random checkpoint of SmolLM-135M's shape is served by two in-process
nodes (half the layers each) over loopback TCP, and driven by the gateway's
own generation code (``ChainSession``, the OpenAI API's path without the
tokenizer and HTTP front):

* **second turn** — a chat's first turn (a ~450-token prompt and a short
  greedy answer) runs and ends; the second turn sends the whole
  conversation again plus a new question. Its time to first token (the
  prefill: the first token is sampled from its logits) is measured with
  the prefix cache and, side by side in the same run, cold (no block keys:
  every position computed), alternating, best of the repeats each.
* **shared system prompt** — a 1,000-token system prompt then a short
  question per user, users one after another: the first computes the
  system prompt, the others attach it; their mean TTFT ÷ the first's.

Greedy answers with and without the cache must be equal; the largest
logit difference (the other chunking's float32 rounding) is printed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import numpy as np

from meshnet_bench._greedy import greedy
from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import random_smollm
from meshnet_gateway.openai.generation import ChainSettings
from meshnet_gateway.openai.prefix_index import PrefixIndex
from meshnet_node.model_chain import even_splits, start_model_chain
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool

__all__ = ["run"]

KEYS = (
    "prefix_second_turn_ttft_over_cold",
    "prefix_shared_system_ttft_over_first",
    "prefix_answers_equal",
    "prefix_max_logit_diff",
)


@dataclass(frozen=True, slots=True)
class _Plan:
    layers: int
    first_turn: int
    answer: int
    question: int
    system: int
    users: int
    repeats: int
    label: str


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan(
            layers=2,
            first_turn=70,
            answer=2,
            question=8,
            system=64,
            users=2,
            repeats=1,
            label="toy 2-layer model",
        )
    if options.quick:
        return _Plan(
            layers=8,
            first_turn=450,
            answer=8,
            question=24,
            system=1000,
            users=4,
            repeats=2,
            label="SmolLM-135M shape, 8 layers",
        )
    return _Plan(
        layers=30,
        first_turn=450,
        answer=16,
        question=24,
        system=1000,
        users=16,
        repeats=3,
        label="SmolLM-135M shape, 30 layers",
    )


@dataclass(slots=True)
class _Figures:
    cold: float = float("inf")  # best second-turn TTFT, seconds
    warm: float = float("inf")
    equal: bool = True
    max_diff: float = 0.0
    first_user: float = 0.0
    other_users: float = 0.0


async def _measure(
    directory: str, plan: _Plan, vocab: int, progress: Callable[[str], None]
) -> _Figures:
    rng = np.random.default_rng(0)
    figures = _Figures()
    async with AsyncExitStack() as stack:
        nodes = await stack.enter_async_context(
            start_model_chain(directory, even_splits(plan.layers, 2))
        )
        pool = DownstreamPool(nodes[0].url)
        stack.push_async_callback(pool.aclose)
        codecs = CodecPool()
        base = dict(chunk_tokens=128, inflight=1, encoding="identity", zstd_level=3, timeout=600.0)
        cold = ChainSettings(**base)  # type: ignore[arg-type]
        await greedy(pool, codecs, cold, [1] * 40, 2)  # warm-up: weights touched, threads up
        for repeat in range(plan.repeats):
            progress(f"prefix: second turn, repeat {repeat + 1}/{plan.repeats}")
            warm = ChainSettings(**base, prefix=PrefixIndex())  # type: ignore[arg-type]
            first = [int(t) for t in rng.integers(0, vocab, plan.first_turn)]
            answer = (await greedy(pool, codecs, warm, first, plan.answer)).tokens
            second = first + answer + [int(t) for t in rng.integers(0, vocab, plan.question)]
            cold_run = await greedy(pool, codecs, cold, second, plan.answer)
            warm_run = await greedy(pool, codecs, warm, second, plan.answer)
            figures.cold = min(figures.cold, cold_run.ttft)
            figures.warm = min(figures.warm, warm_run.ttft)
            figures.equal &= cold_run.tokens == warm_run.tokens
            diff = float(np.max(np.abs(cold_run.first_logits - warm_run.first_logits)))
            figures.max_diff = max(figures.max_diff, diff)
        progress(f"prefix: a {plan.system}-token system prompt shared by {plan.users} users")
        shared = ChainSettings(**base, prefix=PrefixIndex())  # type: ignore[arg-type]
        system = [int(t) for t in rng.integers(0, vocab, plan.system)]
        times = []
        for _ in range(plan.users):
            question = [int(t) for t in rng.integers(0, vocab, plan.question)]
            times.append((await greedy(pool, codecs, shared, system + question, 1)).ttft)
        figures.first_user = times[0]
        figures.other_users = sum(times[1:]) / len(times[1:])
    return figures


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    result = SectionResult(title=f"Prefix cache over a 2-node chain ({plan.label}, loopback)")
    with random_smollm(options, plan.layers, plan.label, "prefix") as (directory, config):
        f = anyio.run(
            _measure,
            directory,
            plan,
            config.vocab_size,
            options.progress,
            backend=options.async_backend,
        )
    second_turn = plan.first_turn + plan.answer + plan.question
    result.keys = {
        "prefix_second_turn_tokens": second_turn,
        "prefix_second_turn_ttft_over_cold": round(f.warm / f.cold, 3),
        "prefix_shared_system_ttft_over_first": round(f.other_users / f.first_user, 3),
        "prefix_answers_equal": int(f.equal),
        "prefix_max_logit_diff": float(f"{f.max_diff:.3g}"),
    }
    result.rows = [
        {
            "workload": f"second turn ({second_turn} tokens), cold",
            "TTFT ms": f"{1000 * f.cold:.0f}",
            "vs cold": "1.00",
        },
        {
            "workload": f"second turn ({second_turn} tokens), prefix cache",
            "TTFT ms": f"{1000 * f.warm:.0f}",
            "vs cold": f"{f.warm / f.cold:.2f}",
        },
        {
            "workload": f"{plan.system}-token system prompt, first user",
            "TTFT ms": f"{1000 * f.first_user:.0f}",
            "vs cold": "1.00",
        },
        {
            "workload": f"same, users 2..{plan.users} (mean)",
            "TTFT ms": f"{1000 * f.other_users:.0f}",
            "vs cold": f"{f.other_users / f.first_user:.2f}",
        },
    ]
    result.notes.append(
        f"Greedy answers with and without the cache equal: {'yes' if f.equal else 'NO'}; "
        f"largest logit difference {f.max_diff:.2g} (the suffix is chunked differently)."
    )
    return result

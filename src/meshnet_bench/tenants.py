"""``meshnet bench`` section: the PIN search of issue 37, with one tenant and
with tenants apart (wire-2 §3.15).

A random checkpoint of SmolLM-135M's shape is served by two in-process
nodes over loopback TCP and driven by the gateway's own generation code
(``ChainSession``) with one prefix index, as one gateway would. A victim
sends a system prompt holding a 4-token "PIN" and a question; an attacker
then sends the same system prompt with each of ten PINs (one right) and its
own question, and the time to first token of each guess is measured:

* **one tenant** (a gateway without API keys: every client shares the
  cache) — the right guess attaches the victim's whole prompt and answers
  in a fraction of a wrong guess's time: one sample finds the PIN;
* **tenants apart** (the victim and the attacker hold keys of two tenants)
  — the attacker's keys start from its own salt, so the right guess
  attaches nothing of the victim's and costs what a wrong one costs.

Printed: the right guess's TTFT over the wrong guesses' median in each, and
how many of the attacker's prefills attached the victim's prefix.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace

import anyio
import numpy as np

from meshnet_bench._greedy import greedy
from meshnet_bench._result import BenchOptions, SectionResult
from meshnet_bench._support import random_smollm
from meshnet_gateway.openai.generation import ChainSettings
from meshnet_gateway.openai.prefix_index import PrefixIndex
from meshnet_gateway.tenancy import Tenancy, tenancy_of
from meshnet_node.model_chain import even_splits, start_model_chain
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool

__all__ = ["KEYS", "run"]

KEYS = (
    "tenants_one_tenant_right_over_wrong",
    "tenants_apart_right_over_wrong",
    "tenants_apart_victim_hits",
    "tenants_one_tenant_victim_hits",
)
GUESSES = 10
RIGHT = 7  # which guess is the PIN
PIN_AT = 100  # token offset of the PIN in the system prompt (inside block 3)


@dataclass(frozen=True, slots=True)
class _Plan:
    layers: int
    system: int
    question: int
    label: str


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan(layers=2, system=160, question=8, label="toy 2-layer model")
    if options.quick:
        return _Plan(layers=8, system=370, question=16, label="SmolLM-135M shape, 8 layers")
    return _Plan(layers=30, system=370, question=16, label="SmolLM-135M shape, 30 layers")


@dataclass(slots=True)
class _Search:
    right: float = 0.0  # seconds: the right guess's TTFT
    wrong: list[float] = field(default_factory=list)
    victim_hits: int = 0  # attacker prefills that attached the victim's blocks

    @property
    def ratio(self) -> float:
        return self.right / statistics.median(self.wrong)


async def _search(
    pool: DownstreamPool,
    codecs: CodecPool,
    base: ChainSettings,
    plan: _Plan,
    victim: Tenancy | None,
    attacker: Tenancy | None,
    rng: np.random.Generator,
    vocab: int,
) -> _Search:
    """One victim prompt, then ten guesses of its PIN; a fresh index (one gateway)."""
    settings = replace(base, prefix=PrefixIndex())
    prompt = [int(t) for t in rng.integers(0, vocab, plan.system)]
    pins = [[int(t) for t in rng.integers(0, vocab, 4)] for _ in range(GUESSES)]

    def with_pin(pin: list[int]) -> list[int]:
        return prompt[:PIN_AT] + pin + prompt[PIN_AT + 4 :]

    question = [int(t) for t in rng.integers(0, vocab, plan.question)]
    await greedy(pool, codecs, settings, with_pin(pins[RIGHT]) + question, 1, tenancy=victim)
    search = _Search()
    own = [int(t) for t in rng.integers(0, vocab, plan.question)]
    index_ = settings.prefix
    assert index_ is not None
    for index, pin in enumerate(pins):
        saved = index_.tokens_saved
        run = await greedy(pool, codecs, settings, with_pin(pin) + own, 1, tenancy=attacker)
        # Positions attached past the PIN's block: only the victim's prompt has them.
        past_pin = index_.tokens_saved - saved > PIN_AT // 32 * 32
        if index == RIGHT:
            search.right = run.ttft
            search.victim_hits += int(past_pin)
        else:
            search.wrong.append(run.ttft)
    return search


async def _measure(
    directory: str, plan: _Plan, vocab: int, progress: Callable[[str], None]
) -> tuple[_Search, _Search]:
    rng = np.random.default_rng(0)
    async with AsyncExitStack() as stack:
        nodes = await stack.enter_async_context(
            start_model_chain(directory, even_splits(plan.layers, 2))
        )
        pool = DownstreamPool(nodes[0].url)
        stack.push_async_callback(pool.aclose)
        codecs = CodecPool()
        base = ChainSettings(
            chunk_tokens=128, inflight=1, encoding="identity", zstd_level=3, timeout=600.0
        )
        await greedy(pool, codecs, base, [1] * 40, 1)  # warm-up
        progress("tenants: ten PIN guesses, one tenant (no API keys)")
        one = await _search(pool, codecs, base, plan, None, None, rng, vocab)
        progress("tenants: ten PIN guesses, victim and attacker in two tenants")
        apart = await _search(
            pool,
            codecs,
            base,
            plan,
            tenancy_of("victim", None, None),
            tenancy_of("attacker", None, None),
            rng,
            vocab,
        )
    return one, apart


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    result = SectionResult(title=f"The PIN search across tenants ({plan.label}, loopback)")
    with random_smollm(options, plan.layers, plan.label, "tenants") as (directory, config):
        one, apart = anyio.run(
            _measure,
            directory,
            plan,
            config.vocab_size,
            options.progress,
            backend=options.async_backend,
        )
    result.keys = {
        "tenants_one_tenant_right_over_wrong": round(one.ratio, 3),
        "tenants_apart_right_over_wrong": round(apart.ratio, 3),
        "tenants_apart_victim_hits": apart.victim_hits,
        "tenants_one_tenant_victim_hits": one.victim_hits,
    }
    for name, search in (("one tenant (no API keys)", one), ("tenants apart", apart)):
        result.rows.append(
            {
                "attacker's guesses": name,
                "right guess TTFT ms": f"{1000 * search.right:.0f}",
                "wrong guesses ms (min-max)": f"{1000 * min(search.wrong):.0f}-"
                f"{1000 * max(search.wrong):.0f}",
                "right / wrong median": f"{search.ratio:.2f}",
            }
        )
    result.notes.append(
        f"A {plan.system}-token system prompt with a 4-token PIN at {PIN_AT}; {GUESSES} guesses. "
        f"The right guess attached the victim's prefix past the PIN: one tenant "
        f"{one.victim_hits} time(s), apart {apart.victim_hits} (it must be 0)."
    )
    return result

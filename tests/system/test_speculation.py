"""Speculative decoding on the real model, over real processes (issue 38, wire-2 §3.16).

SmolLM2-135M-Instruct (Q4_1 GGUF) split over 2 and over 3 node processes,
and two gateway processes over the same chain: one with ``--speculate off``,
one drafting by prompt lookup with windows in flight. On prompts that repeat
a given text (what drafting is for), greedy and seeded temperature-0.8
answers are equal, character for character; the speculating gateway's
``/metrics`` and access lines show windows drafted and accepted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from support.gateway import stop
from support.model_surface import spawn_logged
from support.smollm2 import smollm2_gguf
from support.speculation import chat_text, spec_counters

pytestmark = pytest.mark.slow

LAYERS = 30  # SmolLM2-135M's
LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
PROMPTS = [
    f"Repeat this list exactly: {LIST}.",
    "Copy this sentence exactly: the quick brown fox jumps over the lazy dog, and the dog sleeps.",
]
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "seed": 1234},
}
TOKENS = 40


@contextmanager
def chain(stages: int, logs: Path) -> Iterator[tuple[str, str, Path]]:
    """Node processes over SmolLM2's layers and two gateways over them:
    (plain gateway URL, speculating gateway URL, the latter's log)."""
    model = str(smollm2_gguf())
    cut = [LAYERS * i // stages for i in range(stages + 1)]
    with ExitStack() as stack:

        def start(module: str, args: list[str], name: str) -> str:
            proc, url = spawn_logged(module, args, logs / f"{name}.log")
            stack.callback(lambda: proc.poll() is None and stop(proc))
            return url

        after: list[str] = []
        for i in reversed(range(stages)):
            flags = ["--model", model, "--layers", f"{cut[i]}:{cut[i + 1]}", "--threads", "1"]
            after = ["--next", start("meshnet_node", flags + after, f"node{i}")]
        entry = ["--entry", after[1], "--model", model, "--log-level", "info"]
        plain = start("meshnet_gateway", [*entry, "--speculate", "off"], "plain")
        flags = ["--speculate", "lookup", "--speculate-max-draft", "6", "--speculate-windows", "2"]
        yield plain, start("meshnet_gateway", [*entry, *flags], "spec"), logs / "spec.log"


@pytest.mark.parametrize("stages", [2, 3])
def test_speculation_answers_exactly_what_plain_decoding_does(stages: int, tmp_path: Path) -> None:
    with chain(stages, tmp_path) as (plain, spec, log):
        for prompt in PROMPTS:
            for name, sampling in SAMPLING.items():
                expected = chat_text(plain, prompt, TOKENS, **sampling)
                assert chat_text(spec, prompt, TOKENS, **sampling) == expected, (name, prompt)
        figures = spec_counters(spec)
        off = spec_counters(plain)
    assert figures["meshnet_openai_speculative_drafted_tokens_total"] > 0, figures
    assert figures["meshnet_openai_speculative_accepted_tokens_total"] > 0, figures
    assert figures["meshnet_openai_speculative_fallbacks_total"] == 0
    assert 0 < figures["meshnet_openai_speculative_acceptance_rate"] <= 1
    assert off["meshnet_openai_speculative_windows_total"] == 0
    drafted = [int(n) for n in re.findall(r" drafted=(\d+) accepted=\d+ ", log.read_text())]
    assert len(drafted) == len(PROMPTS) * len(SAMPLING) and sum(drafted) > 0

"""The prefix section of ``meshnet bench`` runs end to end (tiny mode): the
cache's answers equal the cold chain's, and it reports its keys."""

from __future__ import annotations

from meshnet_bench import prefix
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, TARGETS


def test_prefix_section_tiny_equal_answers_and_its_keys() -> None:
    lines: list[str] = []
    result = prefix.run(BenchOptions(tiny=True, progress=lines.append))
    assert "prefix" in SECTIONS and "prefix_second_turn_ttft_over_cold" in TARGETS
    assert set(prefix.KEYS) <= set(result.keys)
    assert result.keys["prefix_answers_equal"] == 1
    assert result.keys["prefix_second_turn_ttft_over_cold"] > 0
    assert result.keys["prefix_shared_system_ttft_over_first"] > 0
    assert len(result.rows) == 4 and any("system prompt" in line for line in lines)

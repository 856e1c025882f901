"""The spec section of ``meshnet bench`` runs end to end (tiny mode): both
chains answer every task, greedy texts are identical with speculation on
and off, and the section reports its keys."""

from __future__ import annotations

from meshnet_bench import spec
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, TARGETS


def test_spec_section_tiny_compares_speculation_with_it_off() -> None:
    lines: list[str] = []
    result = spec.run(BenchOptions(tiny=True, progress=lines.append))
    assert "spec" in SECTIONS and TARGETS["spec_wifi_draftable_speedup"] == (">=", 2.5)
    assert set(spec.KEYS) <= set(result.keys)
    assert result.keys["spec_greedy_identical"] is True
    assert all(row["same text"] == "yes" for row in result.rows)
    assert len(result.rows) == 4  # 2 profiles x 2 tasks
    # The tiny random model repeats itself: prompt lookup drafts, and some
    # drafts are accepted (the counters come from the gateway's /metrics).
    listed = [row for row in result.rows if row["task"] == "list"]
    assert all(int(row["drafted"]) > 0 and float(row["accepted"]) > 0 for row in listed)
    assert any("spec: 2 stages" in line for line in lines)

"""Smoke test of the ``meshnet bench`` concurrency section: it runs end to end
on the tiny sizes and reports its keys (no timing is asserted)."""

from __future__ import annotations

from meshnet_bench import BenchOptions
from meshnet_bench.concurrency import run


def test_concurrency_section_reports_scaling_at_64_sessions() -> None:
    lines: list[str] = []
    result = run(BenchOptions(tiny=True, progress=lines.append))
    assert result.keys["concurrency_scaling_64"] is not None
    assert result.keys["concurrency_scaling_64"] > 0
    assert [row["sessions"] for row in result.rows] == ["1", "8", "64"]
    assert len(lines) == 3 and "64 session(s)" in lines[-1]

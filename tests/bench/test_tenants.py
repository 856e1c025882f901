"""The tenants section of ``meshnet bench`` runs end to end (tiny mode): with
one tenant the right PIN guess attaches the victim's prefix, with tenants
apart it never does, and the section reports its keys."""

from __future__ import annotations

from meshnet_bench import tenants
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, TARGETS


def test_tenants_section_tiny_finds_nothing_across_tenants() -> None:
    lines: list[str] = []
    result = tenants.run(BenchOptions(tiny=True, progress=lines.append))
    assert "tenants" in SECTIONS and "tenants_apart_right_over_wrong" in TARGETS
    assert set(tenants.KEYS) <= set(result.keys)
    assert result.keys["tenants_apart_victim_hits"] == 0
    assert result.keys["tenants_one_tenant_victim_hits"] == 1  # the attack, shown to work
    assert result.keys["tenants_one_tenant_right_over_wrong"] > 0
    assert len(result.rows) == 2 and any("two tenants" in line for line in lines)

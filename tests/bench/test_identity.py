"""The identity section of ``meshnet bench`` runs end to end (tiny mode) and owns its keys."""

from __future__ import annotations

from meshnet_bench import identity
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS


def test_identity_section_tiny_loads_with_and_without() -> None:
    lines: list[str] = []
    result = identity.run(BenchOptions(tiny=True, progress=lines.append))
    assert "identity" in SECTIONS
    whats = ("load_ratio", "cpu_ratio", "peak_ratio", "share")
    assert set(result.keys) == {f"identity_tiny_{w}" for w in whats}
    assert all(isinstance(v, float) and v > 0 for v in result.keys.values())
    (row,) = result.rows
    assert row["case"] == "tiny" and row["layers"] == "all"
    assert any("identity: tiny" in line for line in lines)


def test_identity_keys_declared() -> None:
    assert len(identity.KEYS) == 12  # 3 cases x 4 figures
    assert all(key.startswith("identity_") for key in identity.KEYS)

"""The model section of ``meshnet bench`` runs end to end (tiny mode) and owns its keys.

No timing is asserted: the figures are ratios measured side by side, for
people to read, and the machine running the tests is shared.
"""

from __future__ import annotations

import math

from meshnet_bench import BenchOptions, SectionResult
from meshnet_bench.model import run

KEYS = {
    "model_split2_over_single_decode",
    "model_split2_over_single_prefill",
    "model_split3_over_single_decode",
    "model_split3_over_single_prefill",
    "model_split2_pipelined_prefill_over_single",
    "model_split3_pipelined_prefill_over_single",
    "model_decode_wire_share",
    "model_single_prefill_tokens_per_s",
    "model_single_decode_tokens_per_s",
}


def test_model_section_reports_its_keys_and_rows() -> None:
    lines: list[str] = []
    result = run(BenchOptions(tiny=True, progress=lines.append))
    assert isinstance(result, SectionResult)
    assert set(result.keys) >= KEYS
    assert all(k.startswith("model_") for k in result.keys)
    for key in KEYS:
        value = result.keys[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert 0 < result.keys["model_decode_wire_share"] <= 1  # type: ignore[operator]
    assert result.keys["model_splits_bit_identical"] == 1
    assert [row["nodes"] for row in result.rows] == ["1", "2", "3"]
    assert lines and all(line.startswith("model:") for line in lines)

"""The pd section of ``meshnet bench`` runs end to end (tiny mode): two
pinned node processes, each mode in turn; the answers are equal with and
without disaggregation, sessions moved by their KV with nothing replayed,
and it reports its keys."""

from __future__ import annotations

from meshnet_bench import pd
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, TARGETS


def test_pd_section_tiny_equal_answers_moves_and_its_keys() -> None:
    lines: list[str] = []
    result = pd.run(BenchOptions(tiny=True, progress=lines.append))
    assert "pd" in SECTIONS and TARGETS["pd_decode_p99_over_mixed"] == ("<=", 0.5)
    assert set(pd.KEYS) <= set(result.keys)
    assert result.keys["pd_answers_equal"] == 1
    # Every session (the warm-up, the streams, the long prompts, the probe)
    # moved from the prefill replica to the decode one before decoding.
    handoffs = result.keys["pd_handoffs"]
    assert isinstance(handoffs, int) and handoffs >= 4
    mixed, split = result.rows
    assert mixed["KV moves"] == "0" and split["replayed chunks"] == "0"
    for key in ("pd_decode_p99_mixed_ms", "pd_decode_p99_disaggregated_ms",
                "pd_decode_p99_over_mixed", "pd_long_ttft_over_mixed"):  # fmt: skip
        value = result.keys[key]
        assert isinstance(value, float) and value > 0, (key, value)
    assert any("disaggregated (--kv-role prefill,decode)" in line for line in lines)

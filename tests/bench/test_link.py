"""``meshnet bench --only link`` at tiny sizes: two chains behind emulated
links, this tree's last-stage sampling against the relayed logits.

Timings at tiny sizes mean nothing; bytes do: a token's answer climbing the
chain is a few hundred bytes (an HTTP head and 4 bytes of id) where the
relayed path carries the logits row.
"""

from __future__ import annotations

import pytest

from meshnet_bench import link
from meshnet_bench._result import BenchOptions
from meshnet_bench.emulated_link import PROFILES

pytestmark = pytest.mark.slow


def test_the_floor_is_compute_plus_the_trips_delays_plus_its_bytes_at_the_rate() -> None:
    loopback = link.Trial(ttft_s=0.1, ms_per_token=20.0, bytes_up=500.0, bytes_down=700.0)
    wifi = link.Trial(ttft_s=0.2, ms_per_token=50.0, bytes_up=500.0, bytes_down=700.0)
    # 2 stages: 4 one-way delays of 5 ms; 2 hops x 1,200 bytes at 100 Mbit/s.
    expected = 20.0 + 4 * 5.0 + 1000 * 2 * 1200 * 8 / 100e6
    assert link.floor_ms(wifi, loopback, "wifi", 2) == pytest.approx(expected)
    assert link.floor_ms(loopback, loopback, "loopback", 3) == 20.0
    # Polled straight from the last stage: 3 one-way delays, not 4.
    assert link.floor_ms(wifi, loopback, "wifi", 2, direct=True) == pytest.approx(expected - 5.0)
    assert [link.crossings(s, True) for s in (1, 2, 3)] == [2, 3, 4]
    assert wifi.tok_s == 20.0 and set(PROFILES) == {"loopback", "lan", "wifi", "wan"}


def test_tiny_link_section_runs_both_chains_and_the_answers_shrink() -> None:
    lines: list[str] = []
    result = link.run(BenchOptions(tiny=True, progress=lines.append))
    assert set(result.keys) == set(link.KEYS)
    rows = {(row["link"], row["tree"]): row for row in result.rows}
    trees = ("after", "relayed", "before")
    assert set(rows) == {(p, t) for p in ("loopback", "wifi") for t in trees}

    def up(profile: str, tree: str) -> int:
        return int(rows[(profile, tree)]["up B/tok/hop"].replace(",", ""))

    # The tiny model's logits are 260 float32 (1,040 bytes) a token and hop.
    for profile in ("loopback", "wifi"):
        # Relayed: the same hops, the logits row gone from each answer: the
        # tree before carries it (1,040 bytes and its head), the relayed tree
        # less than the row alone. (Not their difference: on a loaded machine
        # the relayed tree's polls add a few hundred bytes a token.)
        assert up(profile, "relayed") < 1040 <= up(profile, "before")
        # After: no logits either, but its per-hop mean also spreads the
        # polls' own link over the steps, as many as were polled (a probe a
        # generation on loopback, all of them on a loaded machine): held to
        # the 1 KiB, which a relayed logits row alone (1,040) exceeds.
        assert up(profile, "after") <= 1024
    assert up("wifi", "before") >= 1040
    assert result.keys["link_wifi_bytes_up_per_token_hop"] == up("wifi", "after") <= 1024
    assert all(value is not None and value > 0 for value in result.keys.values())
    assert any("tiny, 2 stages" in line for line in lines)

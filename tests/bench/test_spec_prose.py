"""``python -m meshnet_bench.spec_prose``: paired rounds of prose with
speculation on and off, on a toy model (its figures mean nothing)."""

from __future__ import annotations

import re

import pytest

from meshnet_bench import spec_prose


@pytest.mark.slow  # two chains of processes
def test_paired_rounds_print_each_ratio_and_their_median(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert spec_prose.main(["--model", "tiny", "--rounds", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rounds = [line for line in out if line.startswith("round ")]
    assert len(rounds) == 2 and all("ratio " in line for line in rounds)
    summary = out[-1]
    assert summary.startswith("prose on loopback, 2 stages, 2 paired rounds")
    found = re.search(r"ratio median ([\d.]+), mean ([\d.]+)", summary)
    assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0
    assert summary.endswith("same text: yes")


def test_a_link_profile_it_does_not_know_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        spec_prose.main(["--link", "moon"])
    assert refused.value.code == 2
    assert "invalid choice: 'moon'" in capsys.readouterr().err

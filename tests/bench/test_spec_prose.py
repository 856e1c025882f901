"""``python -m meshnet_bench.spec_prose``: paired rounds of prose with
speculation on and off. The chains and the measuring are the spec section's
own (``link.chain``, ``spec.measure``: tests/bench/test_spec.py runs them on
real processes); here the rounds are given, and what is printed is checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshnet_bench import spec_prose
from meshnet_bench.spec import Trial


def _trial(tok_s: float, text: str = "the same story") -> Trial:
    return Trial(tok_s, 128, text, drafted=11, accepted=0, windows=5, stale=0)


def _rounds(
    monkeypatch: pytest.MonkeyPatch, pairs: list[tuple[Trial, Trial]]
) -> list[tuple[str, int, str]]:
    """``main`` given these rounds; the (file, rounds, link) it asked for, once run."""
    asked: list[tuple[str, int, str]] = []

    async def paired_rounds(path: Path, rounds: int, link: str) -> list[tuple[Trial, Trial]]:
        asked.append((path.name, rounds, link))
        for number, (on, off) in enumerate(pairs, 1):
            print(f"round {number}: spec {on.tok_s:.1f} tok/s, off {off.tok_s:.1f}")
        return pairs

    monkeypatch.setattr(spec_prose, "paired_rounds", paired_rounds)
    monkeypatch.setattr(spec_prose, "model_file", lambda kind, scratch: scratch / f"{kind}.gguf")
    return asked


def test_the_summary_is_the_median_of_the_rounds_ratios(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = [(_trial(18.0), _trial(20.0)), (_trial(19.0), _trial(19.0)), (_trial(21), _trial(20))]
    asked = _rounds(monkeypatch, pairs)
    assert spec_prose.main(["--rounds", "3", "--link", "wifi"]) == 0
    assert asked == [("real.gguf", 3, "wifi")]
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("prose on wifi, 2 stages, 3 paired rounds")
    found = re.search(r"ratio median ([\d.]+), mean ([\d.]+), range ([\d.]+)-([\d.]+)", summary)
    assert found and found.groups() == ("1.000", "0.983", "0.900", "1.050")
    assert summary.endswith("same text: yes")


def test_a_round_whose_texts_differ_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _rounds(monkeypatch, [(_trial(18.0, "one story"), _trial(18.0, "another"))])
    assert spec_prose.main(["--rounds", "1"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("same text: NO")


def test_a_link_profile_it_does_not_know_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        spec_prose.main(["--link", "moon"])
    assert refused.value.code == 2
    assert "invalid choice: 'moon'" in capsys.readouterr().err

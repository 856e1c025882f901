"""The fuzz harness's invariant, run briefly on every test run.

fuzz/fuzz_server_connection.py's `exercise()` feeds bytes to a
ServerConnection split at given points and drives it like a driver; it
raises if anything but an event comes out. Here it runs over the seed
corpus, a few hundred deterministic random mutations, and a hypothesis
property test.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HARNESS = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_server_connection.py"


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_server_connection", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


harness = load_harness()
CORPUS: list[bytes] = harness.seed_corpus()


@pytest.mark.parametrize("index", range(len(CORPUS)))
@pytest.mark.parametrize("token", [None, harness.TOKEN])
def test_seed_corpus_whole_and_bytewise(index: int, token: str | None) -> None:
    data = CORPUS[index]
    whole = harness.exercise(data, [], token=token)
    bytewise = harness.exercise(data, list(range(1, len(data))), token=token)
    # Where the input splits must not change what it means.
    assert whole == bytewise


def test_seed_corpus_covers_success_and_failure() -> None:
    names = [harness.exercise(data, []) for data in CORPUS]
    flat = {name for run in names for name in run}
    assert {"ActivationReceived", "EndpointRequest", "ProtocolErrorReceived"} <= flat


def test_random_mutations() -> None:
    rng = random.Random(20240611)
    for _ in range(400):
        harness.run_input(harness.random_input(rng, CORPUS))


def test_bounded_runner() -> None:
    assert harness.run_bounded(seconds=None, runs=len(CORPUS) + 50, seed=3) == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=600),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=6),
    token=st.sampled_from([None, harness.TOKEN]),
    require_sequencing=st.booleans(),
)
def test_property_arbitrary_bytes(
    data: bytes, cuts: list[int], token: str | None, require_sequencing: bool
) -> None:
    harness.exercise(data, cuts, token=token, require_sequencing=require_sequencing)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(min_value=0, max_value=len(CORPUS) - 1),
    position=st.integers(min_value=0, max_value=2000),
    insert=st.binary(max_size=16),
    delete=st.integers(min_value=0, max_value=16),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
)
def test_property_edited_seeds(
    index: int, position: int, insert: bytes, delete: int, cuts: list[int]
) -> None:
    seed = CORPUS[index]
    position = min(position, len(seed))
    data = seed[:position] + insert + seed[position + delete :]
    harness.exercise(data, cuts)


def test_harness_runs_for_a_bounded_time_as_ci_runs_it() -> None:
    # CI's bounded fuzz run: the script exactly as a developer starts it,
    # random mutation for a few seconds (atheris is not needed for this mode).
    import subprocess

    result = subprocess.run(
        [sys.executable, str(HARNESS), "--seconds", "6", "--seed", "11"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no invariant broken" in result.stdout

"""Fixtures of the model tests: one test over both engines, not a copy per engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from meshnet_model import StageRunner


@pytest.fixture(params=["numpy", "torch"])
def engine(request: pytest.FixtureRequest) -> str:
    """Each engine in turn; torch's run is skipped, visibly, where torch is missing."""
    if request.param == "torch":
        pytest.importorskip("torch")
    return str(request.param)


@pytest.fixture
def load_runner(engine: str) -> Callable[[Path], StageRunner]:
    """``load_runner(checkpoint)``: a float32 stage runner on the test's engine."""

    def load(checkpoint: Path) -> StageRunner:
        if engine == "numpy":
            return StageRunner.load(checkpoint)
        from meshnet_model.engines.torch import load_torch_runner

        return load_torch_runner(checkpoint, dtype="float32")

    return load

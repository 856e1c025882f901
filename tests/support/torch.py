"""Torch-engine stage runners for the tests; they decode through
``support.reference.greedy``, the one loop every engine's chain shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from meshnet_model import StageRunner
from meshnet_model.engines.torch import load_torch_runner
from support.reference import greedy

__all__ = ["CUDA", "DEVICES", "greedy", "torch_runners"]

# Run where CUDA is (.ci/gpu-check.sh); deselected elsewhere (tests/conftest.py).
CUDA = pytest.mark.cuda
# The devices a test that takes ``device`` runs on.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def torch_runners(
    directory: Path, splits: Sequence[tuple[int, int]], dtype: str = "float32", **kwargs: object
) -> list[StageRunner]:
    return [load_torch_runner(directory, range(a, b), dtype=dtype, **kwargs) for a, b in splits]  # type: ignore[arg-type]

"""Greedy decode through a chain of in-process stage runners of any engine.

The same loop as ``reference_support.chain_generate`` (the prompt in chunks,
then one id per run), with the runners given: the torch engine's tests build
torch, numpy and mixed chains from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshnet_model import StageRunner
from meshnet_model.torch_engine import load_torch_runner


def torch_runners(
    directory: Path, splits: Sequence[tuple[int, int]], dtype: str = "float32", **kwargs: object
) -> list[StageRunner]:
    return [load_torch_runner(directory, range(a, b), dtype=dtype, **kwargs) for a, b in splits]  # type: ignore[arg-type]


def greedy(
    runners: Sequence[StageRunner],
    prompt: list[int],
    steps: int,
    *,
    chunk: int = 5,
    session: str = "s",
) -> tuple[list[int], np.ndarray]:
    """The new ids and each step's float32 logits ``[steps, vocab]``."""

    def forward(ids: list[int], position: int) -> np.ndarray:
        x: np.ndarray = np.asarray([ids], dtype=np.int32)
        for runner in runners:
            x = runner.run(session, position, x)
        return x

    logits = None
    for lo in range(0, len(prompt), chunk):
        logits = forward(prompt[lo : lo + chunk], lo)
    assert logits is not None
    ids: list[int] = []
    rows = []
    position = len(prompt)
    for _ in range(steps):
        rows.append(np.array(logits[0], dtype=np.float32))
        ids.append(int(np.argmax(logits[0])))
        logits = forward(ids[-1:], position)
        position += 1
    return ids, np.stack(rows)

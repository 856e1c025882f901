"""A verify window's logit rows (wire-2 §3.16, ``BatchEntry.logit_rows``).

A window is one chunk ``[t, d1 … dk]``; the last stage's head makes the
logits of its last ``k + 1`` positions, row ``i`` the distribution after
its first ``i + 1`` tokens. Greedy identity (speculative decoding gives,
token for token, what plain decoding gives) rests on those rows being the
very logits the ``k + 1`` one-token decode steps would have made: on the
real model (every product int4pack, row-invariant; a window's queries
attend one by one, over exactly a decode step's keys) they are, bit for
bit, through a first and a last stage. The numpy engine's BLAS products are
not row-invariant: there the rows agree to float32 rounding, not to the bit
(docs/models.md, "Verify windows and rewinds").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnet_model import StageInputError, StageRunner
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.stage.runner import StageWork
from meshnet_model.testing import small_config, write_checkpoint
from support.smollm2 import smollm2_gguf

PROMPT = [1, 9690, 314, 253, 2914, 30, 1217, 260, 1743, 42, 33, 17, 5]
WINDOW = [300, 11, 250, 7, 4000, 12, 19, 8, 1000, 2]  # t, then nine drafts


def _ids(tokens: list[int]) -> np.ndarray:
    return np.asarray([tokens], np.int32)


def _window(runners: list[StageRunner], session: str, position: int, tokens: list[int]) -> list:
    """One chunk through the stages in turn, as a window of ``len(tokens)`` rows."""
    x = _ids(tokens)
    for runner in runners:
        work = StageWork(runner.admit(session), position, x, logit_rows=len(tokens))
        runner.run_batch([work])
        x = work.result()
    return x


def _steps(runners: list[StageRunner], session: str, position: int, tokens: list[int]) -> list:
    """The same tokens as one-token decode steps: each step's logits row."""
    rows = []
    for i, token in enumerate(tokens):
        x = _ids([token])
        for runner in runners:
            x = runner.run(session, position + i, x)
        rows.append(x[0])
    return rows


def _prefill(runners: list[StageRunner], session: str) -> None:
    x = _ids(PROMPT)
    for runner in runners:
        x = runner.run(session, 0, x)


@pytest.fixture(scope="module")
def real_stages() -> list[StageRunner]:
    """SmolLM2 split in two, as a 2-node chain holds it."""
    gguf = smollm2_gguf()
    return [load_torch_runner(gguf, range(0, 15), threads=1),
            load_torch_runner(gguf, range(15, 30), threads=1)]  # fmt: skip


def test_a_windows_rows_are_its_decode_steps_logits_bit_for_bit(
    real_stages: list[StageRunner],
) -> None:
    assert all(runner.model.row_invariant for runner in real_stages)
    for session in ("window", "steps"):
        _prefill(real_stages, session)
    window = _window(real_stages, "window", len(PROMPT), WINDOW)
    assert window.shape == (1, len(WINDOW), 49152) and window.dtype == np.float32
    steps = _steps(real_stages, "steps", len(PROMPT), WINDOW)
    for i, row in enumerate(steps):
        assert np.array_equal(window[0, i], row), f"row {i}"
    # And the KV it left is the steps' own: the next decode step agrees too.
    after = len(PROMPT) + len(WINDOW)
    next_window = _steps(real_stages, "window", after, [77])[0]
    assert np.array_equal(next_window, _steps(real_stages, "steps", after, [77])[0])


def test_a_window_batched_with_a_decode_step_keeps_its_bits(
    real_stages: list[StageRunner],
) -> None:
    """A window in a step beside another session's decode step: its rows and
    the decode step's logits are those each makes alone."""
    first, last = real_stages
    for session in ("w-alone", "w-batched", "d-alone", "d-batched"):
        _prefill(real_stages, session)
    alone = _window(real_stages, "w-alone", len(PROMPT), WINDOW)
    decode_alone = _steps(real_stages, "d-alone", len(PROMPT), [9])[0]
    hidden = [_window([first], "w-batched", len(PROMPT), WINDOW),
              first.run("d-batched", len(PROMPT), _ids([9]))]  # fmt: skip
    works = [StageWork(last.admit("w-batched"), len(PROMPT), hidden[0], logit_rows=len(WINDOW)),
             StageWork(last.admit("d-batched"), len(PROMPT), hidden[1])]  # fmt: skip
    last.run_batch(works)
    assert np.array_equal(works[0].result(), alone)
    assert np.array_equal(works[1].result()[0], decode_alone)


def test_on_numpy_the_rows_agree_to_rounding_and_pick_the_same_tokens(tmp_path: Path) -> None:
    runner = StageRunner.load(write_checkpoint(tmp_path, small_config(), seed=5))
    prompt, window = [3, 17, 5, 99, 42, 7, 7, 8, 9, 10, 11], [30, 11, 25, 7, 40, 12, 19]
    for session in ("window", "steps"):
        runner.run(session, 0, _ids(prompt))
    rows = _window([runner], "window", len(prompt), window)[0]
    steps = np.stack(_steps([runner], "steps", len(prompt), window))
    np.testing.assert_allclose(rows, steps, rtol=0, atol=1e-4)
    assert list(rows.argmax(axis=1)) == list(steps.argmax(axis=1))


def test_more_logit_rows_than_tokens_is_the_chunks_own_error(tmp_path: Path) -> None:
    runner = StageRunner.load(write_checkpoint(tmp_path, small_config(), seed=5))
    work = StageWork(runner.admit("s"), 0, _ids([1, 2]), logit_rows=3)
    runner.run_batch([work])
    with pytest.raises(StageInputError, match="3 logit rows"):
        work.result()
    assert runner.cache_of("s") is None or runner.cache_of("s").length == 0  # type: ignore[union-attr]

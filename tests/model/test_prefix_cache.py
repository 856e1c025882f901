"""The stage's prefix cache (wire-2 §3.10) at the runner: a session that
attaches a cached prefix computes only its suffix, and its numbers equal a
cold run's within the tolerance another chunking allows; retained caches
live under the KV budget, least recently used go first, and never refuse a
live session."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet_model import BlockNaming, StageRunner
from meshnet_model.errors import PrefixMismatch, PrefixUnknown
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_proto.lowlevel import prefix_block_keys

BLOCK = 32
NAMING = BlockNaming(BLOCK, prefix_block_keys)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = small_config(max_position_embeddings=512)
    path = tmp_path_factory.mktemp("prefix") / "model"
    write_checkpoint(path, config, seed=3)
    return str(path)


def _run(runner: StageRunner, session: str, ids: list[int], *, start: int = 0,
         prefix: str | None = None, chunk: int = 40) -> np.ndarray:  # fmt: skip
    """Send ``ids[start:]`` in chunks with their block keys; the last logits."""
    keys = prefix_block_keys(ids)
    out = None
    for position in range(start, len(ids), chunk):
        piece = np.asarray([ids[position : position + chunk]], dtype=np.int32)
        first_block = position // BLOCK
        ending = (position + piece.shape[1]) // BLOCK - first_block
        life = runner.admit(session)
        runner.prepare_prefix(life, position, piece, prefix if position == start else None,
                              keys[first_block : first_block + ending], NAMING)  # fmt: skip
        out = runner.run(session, position, piece, life=life)
    assert out is not None
    return out


def _numpy(checkpoint: str) -> StageRunner:
    return StageRunner.load(checkpoint)


def _torch(checkpoint: str) -> StageRunner:
    from meshnet_model.engines.torch import load_torch_runner

    return load_torch_runner(checkpoint, dtype="float32")  # type: ignore[no-any-return]


@pytest.mark.parametrize("load", [_numpy, _torch], ids=["numpy", "torch"])
def test_a_hit_runs_only_the_suffix_and_equals_a_cold_run(checkpoint: str, load) -> None:
    """Both engines' caches (numpy arrays, torch tensors) copy a prefix alike."""
    runner = load(checkpoint)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, runner.config.vocab_size, 200)]
    _run(runner, "a", ids[:150])
    runner.end_session("a")  # retained: it holds filed blocks
    assert runner.prefix.retained == 1 and runner.prefix.retained_bytes > 0
    keys = prefix_block_keys(ids)
    hit = _run(runner, "b", ids, start=128, prefix=keys[3])
    cold = _run(load(checkpoint), "c", ids)
    assert runner.prefix.hits == 1 and runner.prefix.tokens_saved == 128
    np.testing.assert_allclose(hit, cold, rtol=0, atol=1e-4)
    assert int(np.argmax(hit)) == int(np.argmax(cold))


def test_an_unknown_prefix_is_refused_and_creates_nothing(checkpoint: str) -> None:
    runner = StageRunner.load(checkpoint)
    ids = [1] * 64
    piece = np.asarray([ids[32:]], dtype=np.int32)
    life = runner.admit("x")
    runner.prepare_prefix(life, 32, piece, prefix_block_keys(ids)[0], (), NAMING)
    with pytest.raises(PrefixUnknown):
        runner.run("x", 32, piece, life=life)
    assert runner.prefix.misses == 1


def test_the_first_stage_refuses_keys_that_do_not_name_its_tokens(checkpoint: str) -> None:
    runner = StageRunner.load(checkpoint)
    life = runner.admit("x")
    wrong = prefix_block_keys([2] * 32)
    with pytest.raises(PrefixMismatch):
        runner.prepare_prefix(life, 0, np.asarray([[1] * 32], dtype=np.int32), None, wrong,
                              NAMING)  # fmt: skip


def test_retained_caches_give_way_to_live_sessions(checkpoint: str) -> None:
    probe = StageRunner.load(checkpoint)
    _run(probe, "p", [5] * 64)
    one = probe.budget.in_use  # one 64-position session's bytes
    runner = StageRunner.load(checkpoint, kv_budget_bytes=2 * one)
    runner.prefix.limit = 2 * one
    _run(runner, "a", [5] * 64)
    runner.end_session("a")
    _run(runner, "b", [6] * 64)
    runner.end_session("b")
    assert runner.prefix.retained == 2 and runner.budget.in_use == 2 * one
    _run(runner, "c", [7] * 64)  # needs room: the oldest retained cache goes
    assert runner.prefix.retained == 1
    keys_a, keys_b = prefix_block_keys([5] * 64), prefix_block_keys([6] * 64)
    assert runner.prefix.find(keys_a[1]) is None and runner.prefix.find(keys_b[1]) is not None
    runner.end_session("c")
    assert runner.budget.in_use <= runner.budget.limit


def test_a_truncation_unfiles_the_blocks_past_it(checkpoint: str) -> None:
    runner = StageRunner.load(checkpoint)
    ids = [3] * 64
    _run(runner, "a", ids, chunk=64)
    keys = prefix_block_keys(ids)
    assert runner.prefix.find(keys[1]) is not None
    runner.run("a", 32, np.asarray([[4] * 8], dtype=np.int32))  # a retransmission-like rerun
    assert runner.prefix.find(keys[1]) is None and runner.prefix.find(keys[0]) is not None

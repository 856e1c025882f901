"""The KV hand-off (wire-2 §3.11) at the runner: a session exported by one
runner and imported by another of the same stage goes on there bit for bit
as it would have at the first, on both engines; a state that is not this
stage's is refused and nothing is left behind; the import's bytes come out
of the KV budget (set aside by ``hold`` first)."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet_model import KVBudgetExceeded, StageRunner
from meshnet_model.stage.handoff import export_kv, import_kv, kv_layout
from meshnet_model.testing import small_config, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("handoff") / "model"
    write_checkpoint(path, small_config(max_position_embeddings=256), seed=5)
    return str(path)


def _numpy(checkpoint: str, **options: int) -> StageRunner:
    return StageRunner.load(checkpoint, **options)


def _torch(checkpoint: str, **options: int) -> StageRunner:
    from meshnet_model.engines.torch import load_torch_runner

    return load_torch_runner(checkpoint, dtype="float32", **options)  # type: ignore[no-any-return]


def _torch_bf16(checkpoint: str, **options: int) -> StageRunner:
    from meshnet_model.engines.torch import load_torch_runner

    return load_torch_runner(checkpoint, dtype="bfloat16", **options)  # type: ignore[no-any-return]


ENGINES = pytest.mark.parametrize("load", [_numpy, _torch, _torch_bf16],
                                  ids=["numpy", "torch", "torch-bf16"])  # fmt: skip


@ENGINES
def test_an_imported_session_goes_on_bit_for_bit(checkpoint: str, load) -> None:
    source, target = load(checkpoint), load(checkpoint)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, source.config.vocab_size, (1, 37)).astype(np.int32)
    source.run("s", 0, prompt)
    state = export_kv(source, "s")
    assert state is not None and state.shape[4] == 37 and state.shape[1] == 2
    layers, heads, head_dim, dtype, per_position = kv_layout(source)
    assert state.shape == (layers, 2, 1, heads, 37, head_dim) and state.dtype.name == dtype
    assert per_position * 37 == state.nbytes
    import_kv(target, "s", state)
    step = np.asarray([[7]], dtype=np.int32)
    for position in range(37, 40):  # three decode steps at both
        here = source.run("s", position, step)
        there = target.run("s", position, step)
        assert np.array_equal(here, there)
        step = np.asarray([[int(np.argmax(here))]], dtype=np.int32)
    np.testing.assert_array_equal(export_kv(target, "s"), export_kv(source, "s"))


def test_a_state_that_is_not_this_stages_is_refused_and_leaves_nothing(checkpoint: str) -> None:
    runner = _numpy(checkpoint)
    runner.run("s", 0, np.asarray([[1, 2, 3]], dtype=np.int32))
    state = export_kv(runner, "s")
    assert state is not None
    other = _numpy(checkpoint)
    for bad in (state[:1], state.astype(np.float16), state[:, :, :, :1]):
        with pytest.raises(ValueError):
            import_kv(other, "t", bad)
        assert other.sessions == 0 and other.budget.in_use == 0
    with pytest.raises(ValueError):  # a session that already holds a cache
        import_kv(runner, "s", state)
    assert export_kv(runner, "nobody") is None


def test_the_import_is_held_in_the_budget_from_its_head(checkpoint: str) -> None:
    runner = _numpy(checkpoint)
    runner.run("s", 0, np.asarray([[1] * 20], dtype=np.int32))
    state = export_kv(runner, "s")
    assert state is not None
    small = _numpy(checkpoint, kv_budget_bytes=state.nbytes * 2)
    small.budget.hold(state.nbytes)
    assert small.budget.in_use == state.nbytes
    with pytest.raises(KVBudgetExceeded):  # a second one does not fit beside the first
        small.budget.hold(state.nbytes + 1)
    import_kv(small, "s", state, held=state.nbytes)
    assert small.budget.in_use >= state.nbytes and small.sessions == 1
    small.end_session("s")
    assert small.budget.in_use == 0

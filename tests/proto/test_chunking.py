"""Chunk planning (zero-copy views) and reassembly, through the public API."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meshnet_proto import ProtocolError
from meshnet_proto._chunking import Chunk, ChunkAssembler, plan_chunks, token_axis


def test_token_axis() -> None:
    assert token_axis((7,)) == 0
    assert token_axis((1, 128)) == 1
    assert token_axis((1, 128, 4096)) == 1
    assert token_axis((2, 3, 4, 5, 6, 7, 8, 9)) == 1
    with pytest.raises(ValueError):
        token_axis(())


def test_plan_chunks_splits_along_tokens_without_copying() -> None:
    array = np.arange(2 * 300 * 4, dtype=np.float32).reshape(2, 300, 4)
    chunks = plan_chunks(array, 128)
    assert [(c.index, c.total, c.position, c.tokens) for c in chunks] == [
        (0, 3, 0, 128),
        (1, 3, 128, 128),
        (2, 3, 256, 44),
    ]
    for chunk in chunks:
        assert np.shares_memory(chunk.view, array)
        assert chunk.view.shape == (2, chunk.tokens, 4)
        np.testing.assert_array_equal(
            chunk.view, array[:, chunk.position : chunk.position + chunk.tokens]
        )


def test_plan_chunks_rank_one_and_exact_multiples() -> None:
    ids = np.arange(10, dtype=np.int32)
    chunks = plan_chunks(ids, 5)
    assert [c.view.tolist() for c in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert all(np.shares_memory(c.view, ids) for c in chunks)
    whole = plan_chunks(ids, 128)
    assert len(whole) == 1 and whole[0].tokens == 10 and whole[0].total == 1


@pytest.mark.parametrize("chunk_tokens", [0, -1, 1.5, True, "8"])
def test_plan_chunks_refuses_bad_sizes(chunk_tokens: object) -> None:
    with pytest.raises(ValueError):
        plan_chunks(np.zeros((1, 4), np.float32), chunk_tokens)  # type: ignore[arg-type]


def test_plan_chunks_refuses_empty_and_scalar() -> None:
    with pytest.raises(ValueError):
        plan_chunks(np.zeros((1, 0, 4), np.float32), 4)
    with pytest.raises(ValueError):
        plan_chunks(np.float32(1.0).reshape(()), 4)


def test_chunk_is_frozen() -> None:
    chunk = plan_chunks(np.zeros((1, 4), np.float32), 2)[0]
    assert isinstance(chunk, Chunk)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.index = 3  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(
    hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9),
    st.integers(1, 10),
    st.data(),
)
def test_plan_then_assemble_in_any_order_is_the_identity(
    shape: tuple[int, ...], chunk_tokens: int, data: st.DataObject
) -> None:
    array = (
        np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(ml_dtypes.bfloat16)
    )
    chunks = plan_chunks(array, chunk_tokens)
    assert sum(c.tokens for c in chunks) == shape[token_axis(shape)]
    assembler = ChunkAssembler(len(chunks))
    for chunk in data.draw(st.permutations(chunks)):
        assert not assembler.complete
        assembler.add(chunk.index, chunk.view)
    assert assembler.complete and assembler.received == len(chunks) and assembler.missing() == []
    result = assembler.result()
    assert result.dtype == array.dtype
    assert result.tobytes() == array.tobytes()
    assert not np.shares_memory(result, array)


def _expect(info: pytest.ExceptionInfo[ProtocolError], code: str) -> None:
    assert (info.value.status, info.value.code) == (502, code), info.value


def test_assembler_missing_chunks() -> None:
    assembler = ChunkAssembler(3)
    assembler.add(1, np.zeros((1, 2), np.float32))
    assert assembler.total == 3 and assembler.received == 1
    assert assembler.missing() == [0, 2]
    with pytest.raises(ProtocolError) as info:
        assembler.result()
    _expect(info, "chunk_missing")
    assert "first: 0" in info.value.message


def test_assembler_duplicate_chunk() -> None:
    assembler = ChunkAssembler(2)
    assembler.add(0, np.zeros((1, 2), np.float32))
    with pytest.raises(ProtocolError) as info:
        assembler.add(0, np.zeros((1, 2), np.float32))
    _expect(info, "chunk_duplicate")


@pytest.mark.parametrize(
    "second",
    [
        np.zeros((1, 2), np.float16),  # dtype
        np.zeros((2, 2), np.float32),  # leading dimension
        np.zeros((1, 2, 1), np.float32),  # rank
        np.zeros(2, np.float32),  # rank 1
        np.float32(0).reshape(()),  # scalar
    ],
)
def test_assembler_mismatched_chunk(second: np.ndarray) -> None:
    assembler = ChunkAssembler(2)
    assembler.add(0, np.zeros((1, 3), np.float32))
    with pytest.raises(ProtocolError) as info:
        assembler.add(1, second)
    _expect(info, "chunk_mismatch")
    assert assembler.received == 1


def test_assembler_token_axis_may_differ() -> None:
    assembler = ChunkAssembler(2)
    assembler.add(1, np.ones((1, 1, 4), np.float32))
    assembler.add(0, np.zeros((1, 3, 4), np.float32))
    result = assembler.result()
    assert result.shape == (1, 4, 4)
    assert result[0, :, 0].tolist() == [0, 0, 0, 1]
    assert result.flags.writeable


@pytest.mark.parametrize("index", [-1, 2, True, 1.0, "0"])
def test_assembler_bad_index(index: object) -> None:
    with pytest.raises(ProtocolError) as info:
        ChunkAssembler(2).add(index, np.zeros((1, 1), np.float32))  # type: ignore[arg-type]
    _expect(info, "bad_chunk_index")


@pytest.mark.parametrize("total", [0, -1, True, 2.0])
def test_assembler_bad_total(total: object) -> None:
    with pytest.raises(ValueError):
        ChunkAssembler(total)  # type: ignore[arg-type]

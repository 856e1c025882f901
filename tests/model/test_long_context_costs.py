"""A chunk's scratch is costed over the context a session can reach: the KV
budget bounds it, not only ``max_position_embeddings`` (issue 18: with a Llama
3.2's 131,072 positions every 128-token chunk was refused as over 1 GiB)."""

from __future__ import annotations

import pytest

from meshnet_model import StageRunner
from meshnet_model.errors import ChunkTooLarge
from meshnet_model.stage.costs import chunk_cost, reachable_context
from meshnet_model.testing import small_config, write_checkpoint


def test_the_kv_budget_bounds_the_reachable_context() -> None:
    config = small_config(max_position_embeddings=131072, num_hidden_layers=4)
    per_position = 2 * 4 * config.num_key_value_heads * config.head_dim * 4
    assert reachable_context(config, layers=4, batch=1, kv_budget=per_position * 1000) == 1000
    assert reachable_context(config, layers=4, batch=1, kv_budget=1 << 40) == 131072
    assert reachable_context(config, layers=4, batch=1, kv_budget=1) == 1
    halves = reachable_context(config, layers=4, batch=1, kv_budget=per_position * 1000,
                               kv_itemsize=2)  # fmt: skip
    assert halves == 2000


def test_a_long_context_model_takes_its_chunks_under_the_default_limits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 32 heads like a Llama 3.2 1B, its 131,072 positions, a 64 MiB KV budget.
    config = small_config(max_position_embeddings=131072, num_attention_heads=32,
                          num_key_value_heads=8, hidden_size=256, head_dim=8)  # fmt: skip
    directory = write_checkpoint(tmp_path / "m", config)
    runner = StageRunner.load(directory, kv_budget_bytes=64 << 20)
    runner.check_head((1, 128), "int32")  # no longer refused
    unbounded = chunk_cost(config, batch=1, tokens=128, context=131072, last=True, query_block=128)
    assert unbounded.total > runner.max_compute_bytes  # what it was costed at before
    tight = StageRunner.load(directory, kv_budget_bytes=64 << 20, max_compute_bytes=1 << 20)
    with pytest.raises(ChunkTooLarge, match="max-compute-bytes"):
        tight.check_head((1, 128), "int32")


def test_a_chunk_whose_position_is_known_is_costed_over_its_own_context(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = small_config(max_position_embeddings=131072, num_attention_heads=32,
                          num_key_value_heads=8, hidden_size=256, head_dim=8)  # fmt: skip
    directory = write_checkpoint(tmp_path / "m", config)
    # Reaches every position; 64 MiB of scratch: a 128-token chunk near the end
    # of 131,072 positions needs ~150 MiB, the first chunk under 1 MiB.
    runner = StageRunner.load(directory, kv_budget_bytes=1 << 40, max_compute_bytes=64 << 20)
    with pytest.raises(ChunkTooLarge):
        runner.check_head((1, 128), "int32")  # somewhere in 131,072 positions: too costly
    runner.check_head((1, 128), "int32", position=0)  # the header says: the first chunk
    with pytest.raises(ChunkTooLarge):
        runner.check_head((1, 128), "int32", position=120_000)

"""Model stages served by meshnet-node: the node contract over real loopback sockets.

ids int32 [batch, tokens] into the node owning layer 0, float32 logits
[batch, vocab] of the chunk's last position out of the node owning the last
layer, hidden states between; a session's KV cache grows chunk by chunk and
across runs (decode steps), and goes on DELETE, TTL and eviction.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ModelSession, start_model_chain
from meshnet_proto import Response
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool

pytestmark = pytest.mark.anyio

LAYERS = 4
VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=7)


def prompt(tokens: int = 21, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (1, tokens)).astype(np.int32)


def kv_bytes(nodes: list) -> list[int]:  # type: ignore[type-arg]
    return [node.app.stage.runner.kv_bytes_in_use for node in nodes]


async def info(pool: DownstreamPool) -> dict:  # type: ignore[type-arg]
    response = await pool.request("GET", "/info", Deadline.after(10))
    assert isinstance(response, Response) and response.status == 200
    return json.loads(response.body)  # type: ignore[no-any-return]


async def test_ids_to_logits_through_one_node_with_kv_across_runs(checkpoint: Path) -> None:
    ids = prompt()
    reference = StageRunner.load(checkpoint)
    want_prefill = reference.run("r", 0, ids)
    want_decode = reference.run("r", ids.shape[1], np.array([[17]], np.int32))
    async with start_model_chain(checkpoint, [(0, LAYERS)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        session = ModelSession(pool)
        logits = await session.run(ids, chunk_tokens=ids.shape[1])
        assert logits.dtype == np.float32 and logits.shape == (1, VOCAB)
        assert np.array_equal(logits, want_prefill)
        step = await session.decode(17)  # a new run: continues the context
        assert np.array_equal(step, want_decode)
        assert nodes[0].app.table.position(session.session) == ids.shape[1] + 1
        await pool.aclose()


@pytest.mark.parametrize("splits", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
async def test_split_chain_is_bit_identical_to_one_node(
    checkpoint: Path, splits: list[tuple[int, int]]
) -> None:
    ids = prompt()
    want = StageRunner.load(checkpoint).run("r", 0, ids)
    async with start_model_chain(checkpoint, splits) as nodes:
        pool = DownstreamPool(nodes[0].url)
        session = ModelSession(pool)
        assert np.array_equal(await session.run(ids), want)
        assert all(b > 0 for b in kv_bytes(nodes))
        assert await session.delete() == 204
        assert kv_bytes(nodes) == [0] * len(nodes)
        document = await info(pool)
        assert document["stage"]["layers"] == list(splits[0])
        assert document["stage"]["kv_bytes_in_use"] == 0
        await pool.aclose()

"""Model stages served by meshnet-node: the node contract over real loopback sockets.

ids int32 [batch, tokens] into the node owning layer 0, float32 logits
[batch, vocab] of the chunk's last position out of the node owning the last
layer, hidden states between; a session's KV cache grows chunk by chunk and
across runs (decode steps), and goes on DELETE, TTL and eviction.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ChainError, ModelSession, start_model_chain
from meshnet_proto import Response
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.waiting import wait_until

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
        # ModelSession keys its sessions (wire-2 §3.9): a DELETE without the key
        # is refused at the entry and the caches stay; with it, all go.
        refused = await pool.request("DELETE", f"/sessions/{session.session}", Deadline.after(10))
        assert (refused.status, refused.error["code"]) == (403, "session_forbidden")
        assert all(b > 0 for b in kv_bytes(nodes))
        assert await session.delete() == 204
        assert kv_bytes(nodes) == [0] * len(nodes)
        document = await info(pool)
        assert document["stage"]["layers"] == list(splits[0])
        assert document["stage"]["kv_bytes_in_use"] == 0
        await pool.aclose()


async def test_auto_lossless_wire_is_bit_identical_too(checkpoint: Path) -> None:
    ids = prompt()
    want = StageRunner.load(checkpoint).run("r", 0, ids)
    async with start_model_chain(
        checkpoint, [(0, 1), (1, 3), (3, 4)], extra=["--wire-dtype", "auto-lossless"]
    ) as nodes:
        pool = DownstreamPool(nodes[0].url)
        assert np.array_equal(await ModelSession(pool).run(ids), want)
        # Chunked, it is the same chunking through one in-process runner, bit for bit.
        chunked = await ModelSession(pool).run(ids, chunk_tokens=8)
        assert np.array_equal(chunked, await _chunked_reference(checkpoint, ids, 8))
        await pool.aclose()


async def _chunked_reference(checkpoint: Path, ids: np.ndarray, chunk: int) -> np.ndarray:
    runner = StageRunner.load(checkpoint)
    out = None
    for lo in range(0, ids.shape[1], chunk):
        out = runner.run("r", lo, ids[:, lo : lo + chunk])
    assert out is not None
    return out


async def test_chunked_prefill_and_decode_through_a_chain(checkpoint: Path) -> None:
    """Chunk sizes and decode steps over the wire: same numbers as in process."""
    ids = prompt(30)
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        for chunk in (1, 7, 30):
            session = ModelSession(pool)
            got = await session.run(ids[:, :24], chunk_tokens=chunk)
            assert np.array_equal(got, await _chunked_reference(checkpoint, ids[:, :24], chunk))
            for t in range(24, 30):  # decode: one run of [1, 1] per token
                step = await session.decode(int(ids[0, t]))
            whole = StageRunner.load(checkpoint).run("w", 0, ids)
            scale = max(1.0, float(np.abs(whole).max()))
            assert float(np.abs(step - whole).max()) <= 1e-5 * scale
            assert await session.delete() == 204
        assert kv_bytes(nodes) == [0, 0]
        await pool.aclose()


async def test_ttl_expiry_frees_the_kv_cache(checkpoint: Path) -> None:
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)],
                                 extra=["--session-ttl", "2"]) as nodes:  # fmt: skip
        # 2 s, not less: a loaded machine's pause between two chunks of the
        # run must not expire the session before the test looks.
        pool = DownstreamPool(nodes[0].url)
        await ModelSession(pool).run(prompt())
        assert all(kv_bytes(nodes))
        # expiry runs every ttl/4; bounded, not timed
        await wait_until(lambda: not any(kv_bytes(nodes)), "the expired sessions' KV freed")
        assert len(nodes[0].app.table) == len(nodes[1].app.table) == 0
        await pool.aclose()


async def test_kv_budget_full_is_503_with_retry_after_then_delete_makes_room(
    checkpoint: Path,
) -> None:
    per_position = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads, head_dim 16, float32
    budget = 16 * per_position  # one session of <= 16 tokens
    async with start_model_chain(checkpoint, [(0, LAYERS)],
                                 extra=["--kv-budget-bytes", str(budget)]) as nodes:  # fmt: skip
        pool = DownstreamPool(nodes[0].url)
        first = ModelSession(pool)
        await first.run(prompt(10))
        assert kv_bytes(nodes) == [budget]
        second = ModelSession(pool)
        with pytest.raises(ChainError) as refused:
            await second.run(prompt(10))
        assert (refused.value.status, refused.value.code) == (503, "kv_memory_full")
        assert refused.value.retry_after is not None and refused.value.retry_after >= 1
        assert kv_bytes(nodes) == [budget]  # nothing grew
        document = await info(pool)
        assert document["stage"]["kv_budget_bytes"] == budget
        assert document["stage"]["kv_bytes_in_use"] == budget
        assert await first.delete() == 204
        logits = await second.run(prompt(10))  # the refused chunk may simply be sent again
        assert logits.shape == (1, VOCAB)
        await pool.aclose()


async def test_a_chunk_a_stage_cannot_take_is_400_and_the_session_goes_on(
    checkpoint: Path,
) -> None:
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        entry = DownstreamPool(nodes[0].url)
        middle = DownstreamPool(nodes[1].url)
        session = ModelSession(entry)
        with pytest.raises(ChainError) as out_of_range:
            await session.run(np.array([[1, VOCAB]], np.int32))
        assert (out_of_range.value.status, out_of_range.value.code) == (400, "bad_stage_input")
        with pytest.raises(ChainError) as hidden_into_first:
            await ModelSession(middle).send(np.zeros((1, 3), np.float32), 0, 1)
        assert hidden_into_first.value.code == "bad_stage_input"
        with pytest.raises(ChainError) as ids_into_middle:
            await ModelSession(middle).run(np.array([[1, 2]], np.int32))
        assert (ids_into_middle.value.status, ids_into_middle.value.code) == (
            400, "bad_stage_input",
        )  # fmt: skip
        # The refused chunk advanced nothing: the session starts at 0 as if new.
        assert (await session.run(prompt(4))).shape == (1, VOCAB)
        await entry.aclose()
        await middle.aclose()


async def test_a_retransmitted_chunk_replays_its_logits_without_recomputing(
    checkpoint: Path,
) -> None:
    """The response shape ([1, vocab]) differs from the request's ([1, tokens]):
    the sequencer stores and replays it all the same, and no layer runs twice."""
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        session = ModelSession(pool)
        ids = prompt(6)
        first = await session.run(ids)
        calls = [node.app.stage.calls for node in nodes]
        cached = kv_bytes(nodes)
        session.position = 0  # the very same chunk again: index 0, position 0
        again = await session.run(ids)
        assert np.array_equal(first, again)
        assert [node.app.stage.calls for node in nodes] == calls
        assert kv_bytes(nodes) == cached
        assert nodes[1].app.table.position(session.session) == 6
        await pool.aclose()


async def test_metrics_show_the_kv_cache(checkpoint: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with start_model_chain(checkpoint, [(0, LAYERS)],
                                 extra=["--kv-budget-bytes", "1000000"]) as nodes:  # fmt: skip
        pool = DownstreamPool(nodes[0].url)
        await ModelSession(pool).run(prompt())

        async def gauges() -> dict[str, float]:
            response = await pool.request("GET", "/metrics", Deadline.after(10))
            assert isinstance(response, Response)
            return {
                f.name: f.samples[0].value
                for f in text_string_to_metric_families(response.body.decode())
                if f.name.startswith("meshnet_kv_")
            }

        assert await gauges() == {
            "meshnet_kv_cache_bytes": kv_bytes(nodes)[0],
            "meshnet_kv_budget_bytes": 1000000,
        }
        assert kv_bytes(nodes)[0] > 0
        await pool.aclose()


async def test_a_wrong_dtype_is_refused_before_the_body_is_read(checkpoint: Path) -> None:
    from meshnet_runtime.endpoints import parse_endpoint
    from meshnet_runtime.transports import connect

    async with start_model_chain(checkpoint, [(0, LAYERS)]) as nodes:
        stream = await connect(parse_endpoint(nodes[0].url))
        try:
            shape, nbytes = "1,4096,64", 4096 * 64 * 4  # hidden states sent to the ids node
            await stream.send(
                (
                    "POST /forward HTTP/1.1\r\nHost: t\r\n"
                    "Content-Type: application/octet-stream\r\n"
                    f"X-Meshnet-Shape: {shape}\r\nX-Meshnet-Dtype: float32\r\n"
                    "X-Meshnet-Session: 5b1e0c2a-1111-4abc-8def-000000000001\r\n"
                    "X-Meshnet-Chunk-Index: 0\r\nX-Meshnet-Chunk-Total: 1\r\n"
                    f"Content-Length: {nbytes}\r\n\r\n"
                ).encode()
            )  # ... and no body: the answer must come anyway
            with anyio.fail_after(20):
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive()
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(body) < length:
                    body += await stream.receive()
        finally:
            await stream.aclose()
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert json.loads(body)["error"]["code"] == "bad_stage_input"
        assert nodes[0].app.stage.calls == 0


async def test_sessions_interleaved_on_one_chain_keep_their_own_context(
    checkpoint: Path,
) -> None:
    a_ids, b_ids = prompt(10, seed=1), prompt(10, seed=2)
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        a, b = ModelSession(pool), ModelSession(pool)
        got: dict[str, list[np.ndarray]] = {"a": [], "b": []}

        async def drive(name: str, session: ModelSession, ids: np.ndarray) -> None:
            got[name].append(await session.run(ids, chunk_tokens=3))
            for token in (5, 6, 7):
                got[name].append(await session.decode(token))

        async with anyio.create_task_group() as tg:
            tg.start_soon(drive, "a", a, a_ids)
            tg.start_soon(drive, "b", b, b_ids)
        for name, ids in (("a", a_ids), ("b", b_ids)):
            alone = StageRunner.load(checkpoint)
            want = [await _chunked_reference_on(alone, ids, 3)]
            want += [
                alone.run("r", 10 + i, np.array([[t]], np.int32)) for i, t in enumerate((5, 6, 7))
            ]
            assert all(np.array_equal(x, y) for x, y in zip(got[name], want, strict=True)), name
        await pool.aclose()


async def _chunked_reference_on(runner: StageRunner, ids: np.ndarray, chunk: int) -> np.ndarray:
    out = None
    for lo in range(0, ids.shape[1], chunk):
        out = runner.run("r", lo, ids[:, lo : lo + chunk])
    assert out is not None
    return out


async def test_a_stage_computing_a_suffix_is_a_500_never_a_short_frame(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The invariant of shared/seeds/003 at the node: a non-first stage that
    would emit fewer positions than it received fails loudly, by name."""
    from meshnet_model import StageModel, StageWeights
    from meshnet_node import serve_node
    from meshnet_node.config import NodeConfig
    from meshnet_node.model_stage import ModelStage

    class SuffixOnly(StageModel):
        def _layers(self, x, batch):  # type: ignore[no-untyped-def]
            return super()._layers(x, batch)[1:]  # one position short

    # path: the node's identity digests the checkpoint this stage came from.
    runner = StageRunner(StageWeights.load(checkpoint, range(2, 4)), path=str(checkpoint))
    runner.model = SuffixOnly(runner.weights)
    async with AsyncExitStack() as stack:
        config = NodeConfig.load(["--port", "0"], {})
        last = await stack.enter_async_context(serve_node(config, stage=ModelStage(runner)))
        first = await stack.enter_async_context(
            start_model_chain(checkpoint, [(0, 2)], extra=["--next", last.url])
        )
        pool = DownstreamPool(first[0].url)
        with pytest.raises(ChainError) as failed:
            await ModelSession(pool).run(prompt(5))
        assert (failed.value.status, failed.value.code) == (500, "internal_error")
        assert "must execute the full range" in caplog.text
        await pool.aclose()


async def test_kv_full_deep_in_the_chain_then_a_retry_reforwards_without_recomputing(
    checkpoint: Path,
) -> None:
    """503 kv_memory_full from the last node: the entry node keeps its output
    (its stage already ran and its cache advanced); the same chunk sent again
    is reforwarded, not recomputed, and the logits are right."""
    per_position_last = 2 * 2 * 2 * 16 * 4  # layers 2..3 only
    budget = 16 * per_position_last
    async with start_model_chain(
        checkpoint, [(0, 2), (2, 4)], per_node=[[], ["--kv-budget-bytes", str(budget)]]
    ) as nodes:
        pool = DownstreamPool(nodes[0].url)
        first = ModelSession(pool)
        await first.run(prompt(10, seed=1))
        second = ModelSession(pool)
        ids = prompt(10, seed=2)
        with pytest.raises(ChainError) as refused:
            await second.run(ids)
        assert (refused.value.status, refused.value.code) == (503, "kv_memory_full")
        calls = nodes[0].app.stage.calls
        assert await first.delete() == 204
        logits = await second.run(ids)  # the very same chunk: index 0, position 0
        assert nodes[0].app.stage.calls == calls  # reforwarded from the kept output
        assert np.array_equal(logits, StageRunner.load(checkpoint).run("r", 0, ids))
        await pool.aclose()


async def test_expiry_to_make_room_for_a_new_session_frees_the_old_kv(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Table full (--max-sessions 1): a new session makes room by expiring the
    idle one inside the sequencer — and its KV cache goes with it."""
    from meshnet_node import NodeApp

    async def no_background_expiry(self: NodeApp) -> None:
        await anyio.sleep_forever()  # only the make-room path may forget a session

    monkeypatch.setattr(NodeApp, "maintain", no_background_expiry)
    async with start_model_chain(
        checkpoint, [(0, LAYERS)], extra=["--max-sessions", "1", "--session-ttl", "0.3"]
    ) as nodes:
        pool = DownstreamPool(nodes[0].url)
        old = ModelSession(pool)
        await old.run(prompt(20))
        held = kv_bytes(nodes)[0]
        assert held > 0
        await anyio.sleep(0.5)  # stall under test: idle past the TTL, which nothing runs out
        assert old.session in nodes[0].app.table and kv_bytes(nodes) == [held]
        new = ModelSession(pool)
        await new.run(prompt(5))
        assert old.session not in nodes[0].app.table
        assert nodes[0].app.stage.runner.sessions == 1
        assert kv_bytes(nodes)[0] == 16 * 2 * 4 * 2 * 16 * 4  # only the new one's 16 positions
        await pool.aclose()


async def test_pipelined_prefill_gives_the_same_bits_as_one_chunk_at_a_time(
    checkpoint: Path,
) -> None:
    """Chunks in flight together (node 1 on chunk i+1 while node 2 has chunk i):
    the sequencer keeps the order, so the logits are those of the same chunking
    sent one by one."""
    ids = prompt(32)
    async with start_model_chain(checkpoint, [(0, 1), (1, 3), (3, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url, max_connections=8)
        pipelined = ModelSession(pool)
        got = await pipelined.run(ids, chunk_tokens=4, inflight=4)
        assert np.array_equal(got, await _chunked_reference(checkpoint, ids, 4))
        assert pipelined.position == 32
        assert [node.app.table.position(pipelined.session) for node in nodes] == [32] * 3
        step = await pipelined.decode(9)  # and the context goes on from there
        sequential = ModelSession(pool)
        await sequential.run(ids, chunk_tokens=4)
        assert np.array_equal(step, await sequential.decode(9))
        await pool.aclose()

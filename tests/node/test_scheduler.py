"""The stage scheduler (issue 19): what a step takes, and the node-side queue.

``plan_step`` is pure and tested as such; ``ModelStage`` is driven by
concurrent tasks on trio and asyncio, as a node's requests drive it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.stage.runner import SessionLife
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.backends import StageContext
from meshnet_node.model_stage import ModelStage
from meshnet_node.scheduler import (
    MIN_PREFILL_ROWS,
    Work,
    credit_passed_over,
    micro_batches_for,
    plan_step,
)
from meshnet_proto import CapacityError
from support.gguf import build_model, write_model_gguf


def work(tokens: int, *, batch: int = 1, done: int = 0, name: str = "s") -> Work:
    w = Work(SessionLife(name), 0, np.zeros((batch, tokens), np.int32))
    w.done = done
    return w


# ------------------------------------------------------------ plan_step


def test_decode_steps_go_first_and_prefill_gets_as_many_rows_as_they_have() -> None:
    prefill = work(128, name="p")
    decodes = [work(1, name=f"d{i}") for i in range(20)]
    plan = plan_step([prefill, *decodes], budget=256)
    assert [w for w, _ in plan[:20]] == decodes
    # As many prefill rows as decode rows, cut back to an aligned end.
    assert plan[20] == (prefill, 16)


def test_prefill_alone_gets_the_whole_budget_and_a_chunk_is_split() -> None:
    a, b = work(200, name="a"), work(200, name="b")
    assert plan_step([a, b], budget=256) == [(a, 200), (b, 56)]  # 56: an aligned end


def test_sessions_decoding_elsewhere_keep_prefill_to_their_share() -> None:
    """Between micro-batches the queue may hold only a prompt: it still gets
    the decoding group's share, not the budget, or the group about to land
    waits behind a whole chunk."""
    prefill = work(128, name="p")
    assert plan_step([prefill], budget=256, decoding=8) == [(prefill, 8)]
    assert plan_step([prefill], budget=256, decoding=0) == [(prefill, 128)]


def test_a_few_decode_steps_still_leave_the_minimum_to_prefill() -> None:
    prefill, decode = work(128, name="p"), work(1, name="d")
    assert plan_step([decode, prefill], budget=256) == [(decode, 1), (prefill, MIN_PREFILL_ROWS)]


def test_prefill_progresses_when_decode_steps_fill_the_budget() -> None:
    decodes = [work(1, name=f"d{i}") for i in range(300)]
    prefill = work(64, name="p")
    plan = plan_step([*decodes, prefill], budget=256)
    assert len(plan) == 257 and plan[-1] == (prefill, MIN_PREFILL_ROWS)


def test_a_chunk_wider_than_the_budget_still_makes_progress() -> None:
    # 300 rows a token: past the budget, alone in the step, one aligned block.
    wide = work(40, batch=300)
    assert plan_step([wide], budget=256) == [(wide, 8)]


def test_pieces_end_on_aligned_positions() -> None:
    w = Work(SessionLife("s"), 37, np.zeros((1, 100), np.int32))  # positions 37..136
    assert plan_step([w], budget=20) == [(w, 19)]  # to 56, not 57
    w.done = 19
    assert plan_step([w], budget=44) == [(w, 40)]  # 56..96, not 100
    w.done = 95
    assert plan_step([w], budget=40) == [(w, 5)]  # the chunk's end, 137


def test_no_piece_ends_inside_a_whole_tile_of_its_chunk() -> None:
    """A dense stage's tiles (64 aligned positions wholly in the chunk) are
    never cut: a piece ends before a tile, or takes it whole; the chunk's
    partial blocks at its ends are cut as usual."""
    w = Work(SessionLife("s"), 10, np.zeros((1, 200), np.int32))  # positions 10..210
    assert plan_step([w], budget=40, tile=64) == [(w, 38)]  # 10..48: no tile before 64
    w.done = 38
    assert plan_step([w], budget=40, tile=64) == [(w, 16)]  # 48..64: back to the tile
    w.done = 54
    assert plan_step([w], budget=40, tile=64) == [(w, 64)]  # 64..128: the tile whole
    w.done = 182
    assert plan_step([w], budget=16, tile=64) == [(w, 16)]  # 192..208: no whole tile
    assert plan_step([w], budget=16) == [(w, 16)]


def test_the_rest_of_a_split_chunk_is_taken_next() -> None:
    w = work(300, done=256)
    assert plan_step([w], budget=256) == [(w, 44)]


def test_an_unsplittable_chunk_beside_steady_decoders_waits_a_bounded_number_of_steps() -> None:
    # A float stage: a chunk is taken whole or not at all. Two streams are
    # queued at every step (they never leave a gap); the 128-token chunk is
    # credited MIN_PREFILL_ROWS per step it is passed over and goes, whole,
    # beside them once that adds up to its rows.
    prefill = work(128, name="p")
    taken_at = None
    for step in range(1, 100):
        decodes = [work(1, name=f"d{i}") for i in range(2)]
        queue = [*decodes, prefill]
        plan = plan_step(queue, budget=256, split=False)
        if prefill in [w for w, _ in plan]:
            taken_at = step
            break
        assert plan == [(d, 1) for d in decodes]  # passed over, the streams run
        credit_passed_over(queue, plan, budget=256)
    assert taken_at == 128 // MIN_PREFILL_ROWS  # in pieces, the 16th piece would end it too
    assert plan[-1] == (prefill, 128)  # whole: its bits are those of a run alone


def test_credit_goes_to_the_oldest_waiting_chunk_and_not_when_prefill_ran() -> None:
    decode, older, newer = work(1, name="d"), work(64, name="a"), work(64, name="b")
    credit_passed_over([decode, older, newer], [(decode, 1)], budget=256)
    assert (older.credit, newer.credit) == (MIN_PREFILL_ROWS, 0)
    credit_passed_over([decode, older, newer], [(decode, 1), (older, 64)], budget=256)
    assert (older.credit, newer.credit) == (MIN_PREFILL_ROWS, 0)  # a prompt ran: no debt
    credit_passed_over([decode], [(decode, 1)], budget=256)  # nothing waits: nothing owed


def test_the_micro_batch_cap_bounds_decode_steps_only() -> None:
    decodes = [work(1, name=f"d{i}") for i in range(8)]
    prefill = work(10, name="p")
    plan = plan_step([*decodes, prefill], budget=256, decode_cap=3)
    assert [w for w, _ in plan] == [*decodes[:3], prefill]


def test_micro_batches_follow_the_layer_share() -> None:
    assert micro_batches_for(range(0, 15), 30) == 2
    assert micro_batches_for(range(0, 30), 30) == 1
    assert micro_batches_for(range(20, 30), 30) == 3


# ------------------------------------------------------------ ModelStage


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=21)


def ctx(session: str, position: int, tokens: int) -> StageContext:
    return StageContext(session=session, position=position, tokens=tokens, index=0, total=1)


def ids(count: int, seed: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int32) * 7 + seed) % 256).reshape(1, count)


@pytest.mark.anyio
async def test_concurrent_chunks_are_batched_and_equal_their_runs_alone(
    checkpoint: Path,
) -> None:
    reference = StageRunner.load(checkpoint)
    want = [reference.run(f"r{i}", 0, ids(6 + i, i)) for i in range(8)]
    stage = ModelStage(StageRunner.load(checkpoint))
    got: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        got[i] = await stage(ids(6 + i, i), ctx(f"s{i}", 0, 6 + i))

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert stage.scheduler.steps < 8  # some shared a step
    for i in range(8):
        assert np.array_equal(got[i], want[i])
    assert stage.scheduler.queued_rows == 0 and not stage.scheduler.queue


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_gguf(tmp_path_factory.mktemp("q4"), build_model("llama", layers=4), "Q4_0")


@pytest.mark.anyio
async def test_a_chunk_split_across_steps_equals_the_chunk_whole(q4_gguf: Path) -> None:
    """Chunked prefill on a row-invariant (int4pack) stage: 40 rows through
    steps of 16, every position's hidden state the very bits of the chunk
    whole (test_batching has the last stage's logits on the real model)."""
    layers = range(0, 2)
    whole = load_torch_runner(q4_gguf, layers, threads=1).run("w", 0, ids(40, 3))
    stage = ModelStage(load_torch_runner(q4_gguf, layers, threads=1), max_batch_tokens=16)
    got = await stage(ids(40, 3), ctx("s", 0, 40))
    assert stage.scheduler.steps == 3
    assert np.array_equal(got, whole)
    # The session continues where the pieces left it.
    assert stage.runner._lives["s"].cache.length == 40


@pytest.mark.anyio
async def test_a_stage_that_is_not_row_invariant_takes_its_chunks_whole(
    checkpoint: Path,
) -> None:
    whole = StageRunner.load(checkpoint).run("w", 0, ids(40, 3))
    stage = ModelStage(StageRunner.load(checkpoint), max_batch_tokens=16)
    got = await stage(ids(40, 3), ctx("s", 0, 40))
    assert stage.scheduler.steps == 1
    assert np.array_equal(got, whole)


@pytest.mark.anyio
async def test_a_chunk_with_a_bad_id_in_a_later_piece_fails_before_any_piece(
    q4_gguf: Path,
) -> None:
    from meshnet_proto import ProtocolError

    stage = ModelStage(load_torch_runner(q4_gguf, range(0, 2), threads=1), max_batch_tokens=16)
    bad = ids(40, 3)
    bad[0, 30] = 10**6
    with pytest.raises(ProtocolError) as refused:
        await stage(bad, ctx("s", 0, 40))
    assert refused.value.code == "bad_stage_input"
    life = stage.runner._lives["s"]
    assert life.cache is None or life.cache.length == 0  # no piece ran
    assert stage.scheduler.queued_rows == 0


@pytest.mark.anyio
async def test_a_full_queue_is_503_stage_busy_with_retry_after_before_any_work(
    checkpoint: Path,
) -> None:
    runner = StageRunner.load(checkpoint)
    stage = ModelStage(runner, max_queued_tokens=20)
    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await stage(ids(8, i), ctx(f"s{i}", 0, 8))
        except CapacityError as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    refused = [o for o in outcomes.values() if isinstance(o, CapacityError)]
    assert all(e.code == "stage_busy" and e.retry_after >= 1 for e in refused)
    # All four queue before the first step (no await before the queue): 8 + 8
    # tokens fit the 20, the other two do not, however fast the steps run
    # (which two is the loop's choice: trio may start tasks in any order).
    assert len(refused) == 2
    for i, outcome in outcomes.items():
        if isinstance(outcome, CapacityError):  # refused before any work: no cache
            assert runner._lives[f"s{i}"].cache is None
    assert stage.scheduler.queued_rows == 0


@pytest.mark.anyio
async def test_a_request_cancelled_while_queued_leaves_the_queue(q4_gguf: Path) -> None:
    """Its rows leave the count at once; the others finish; the cancelled
    session's next chunk starts clean (whatever pieces ran are dropped)."""
    stage = ModelStage(load_torch_runner(q4_gguf, range(0, 2), threads=1), max_batch_tokens=16)
    results: dict[str, np.ndarray] = {}
    victim = anyio.CancelScope()

    async def one(name: str) -> None:
        results[name] = await stage(ids(200, 1), ctx(name, 0, 200))

    async def cancelled() -> None:
        with victim:
            await stage(ids(200, 9), ctx("gone", 0, 200))

    def after_step(chunks: int, rows: int, seconds: float) -> None:
        # In the event loop, between two steps: the third step's end, when
        # the victim has had pieces computed and has far more queued (200
        # rows, 16 a step shared by three), whatever the machine's speed.
        if stage.scheduler.steps == 3:
            assert "gone" not in results and not victim.cancel_called
            victim.cancel()

    stage.scheduler.on_step = after_step
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "a")
        tg.start_soon(cancelled)
        tg.start_soon(one, "b")
    assert victim.cancel_called and set(results) == {"a", "b"}
    assert stage.scheduler.queued_rows == 0 and not stage.scheduler.queue
    again = await stage(ids(200, 9), ctx("gone", 0, 200))
    want = load_torch_runner(q4_gguf, range(0, 2), threads=1).run("w", 0, ids(200, 9))
    assert np.array_equal(again, want)


@pytest.mark.anyio
async def test_decode_steps_are_stepped_in_micro_batches(checkpoint: Path) -> None:
    runner = StageRunner.load(checkpoint, range(0, 2))  # half the layers: two stages
    stage = ModelStage(runner)
    assert stage.scheduler.micro_batches == 2
    sizes: list[int] = []
    stage.scheduler.on_step = lambda chunks, rows, seconds: sizes.append(chunks)
    for i in range(8):
        await stage(ids(4, i), ctx(f"s{i}", 0, 4))
    for step in range(3):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(stage, ids(1, step), ctx(f"s{i}", 4 + step, 1))
    assert max(sizes[8:]) <= 4  # ceil(8 sessions / 2 stages)

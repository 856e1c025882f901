"""wire-2 §3.16 at the node: verify windows and rewinds.

Units first (``verify_answer``, the drafted-ids check, the scheduler's
plan, the direct return's rewind), then nodes over loopback: a window
verified on an echo stage whose input is its logits; the first stage's
drafted-ids check; a rewind refused where it would reach into an attached
cached prefix; the KV hand-off's epoch; and the real model through a
2-stage chain — a rewound session's next logits are, bit for bit, a fresh
session's fed only the kept tokens, and windows of drafts (some wrong)
give, token for token, the plain greedy output.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnet_model.stage.runner import SessionLife
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.draw import draw_answer, verify_answer
from meshnet_node.drawn_answers import DrawnAnswers
from meshnet_node.model_chain import start_model_chain
from meshnet_node.outgoing import outgoing_changes, relayed_headers
from meshnet_node.scheduler import Work, plan_step
from meshnet_node.serving import RunningNode
from meshnet_node.windows import check_drafted_ids, window_accepted
from meshnet_proto import (
    ActivationResponse,
    ErrorResponse,
    ProtocolError,
    SessionTable,
    WireHeaders,
    encode_for_wire,
)
from meshnet_proto.lowlevel import (
    AfterSpec,
    SampleSpec,
    Ticket,
    decode_tensor,
    prefix_block_keys,
)
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool, key_headers
from meshnet_runtime.http_server import ActivationReply
from support.smollm2 import smollm2_gguf
from support.wire import exchange, http_request

from .test_chain import chain

VOCAB = 50
GREEDY = SampleSpec(seed=1, temperature=0.0)


def crafted(argmaxes: Sequence[int], vocab: int = VOCAB) -> np.ndarray:
    """Window logits ``[1, k + 1, vocab]`` whose row ``i`` peaks at ``argmaxes[i]``."""
    rows = np.random.default_rng(16).standard_normal((len(argmaxes), vocab)).astype("<f4")
    for row, peak in zip(rows, argmaxes, strict=True):
        row[peak] = 10.0
    return rows[None]


# ------------------------------------------------------------------ units


def test_a_greedy_window_answers_the_accepted_drafts_then_the_correction() -> None:
    logits = crafted([5, 6, 9, 1])
    answer = verify_answer(logits, GREEDY, (5, 6, 7), 20)
    assert answer.dtype == np.int32 and answer.tolist() == [[5, 6, 9]]
    assert verify_answer(logits, GREEDY, (5, 6, 9), 20).tolist() == [[5, 6, 9, 1]]  # + bonus
    assert verify_answer(logits, GREEDY, (4, 6, 9), 20).tolist() == [[5]]


def test_a_seeded_window_draws_what_plain_decoding_draws_row_by_row() -> None:
    spec = SampleSpec(seed=77, temperature=1.3, top_k=20, logprobs=3)
    logits = np.random.default_rng(3).standard_normal((1, 5, VOCAB)).astype("<f4")
    plain = [draw_answer(logits[:, i], spec, 10 + i + 1) for i in range(5)]  # §3.13's rows
    tokens = [int(row[0, 0]) for row in plain]
    answer = verify_answer(logits, spec, tuple(tokens[:4]), 10)  # every draft the plain draw
    assert answer.dtype == np.float32 and answer.shape == (5, 8)
    assert np.array_equal(answer, np.concatenate(plain))  # one §3.13 row per token
    wrong = (tokens[0], (tokens[1] + 1) % VOCAB, tokens[2], tokens[3])
    rejected = verify_answer(logits, spec, wrong, 10)
    assert np.array_equal(rejected, np.concatenate(plain[:2]))  # the draw replaces the draft


@pytest.mark.parametrize(
    ("logits", "draft"),
    [
        (np.zeros((1, VOCAB), "<f4"), (1,)),  # one row: no window
        (np.zeros((1, 3, VOCAB), "<f4"), (1,)),  # rows for 2 drafts, 1 drafted
        (np.zeros((1, 2, VOCAB), "<i4"), (1,)),  # ids are no logits
        (np.zeros((1, 2, VOCAB), "<f4"), (VOCAB,)),  # a draft past the vocabulary
    ],
)
def test_what_is_no_window_of_logits_is_400_bad_draft(
    logits: np.ndarray, draft: tuple[int, ...]
) -> None:
    with pytest.raises(ProtocolError) as caught:
        verify_answer(logits, GREEDY, draft, 0)
    assert (caught.value.status, caught.value.code) == (400, "bad_draft")


def test_broken_rows_are_answered_as_they_are() -> None:
    broken = crafted([1, 2])
    broken[0, 1] = np.nan
    assert verify_answer(broken, GREEDY, (1,), 0) is broken


def test_the_first_stage_checks_the_ids_are_the_drafts() -> None:
    headers = WireHeaders(shape=(1, 3), dtype="int32", draft=(5, 6))
    check_drafted_ids(headers, np.array([[9, 5, 6]], np.int32))
    check_drafted_ids(headers.replace(draft=None), np.array([[9, 5, 7]], np.int32))
    with pytest.raises(ProtocolError) as caught:
        check_drafted_ids(headers, np.array([[9, 5, 7]], np.int32))
    assert (caught.value.code, caught.value.header) == ("bad_draft", "x-meshnet-draft")


def _work(tokens: int, logit_rows: int = 1) -> Work:
    ids = np.zeros((1, tokens), np.int32)
    return Work(SessionLife(str(uuid.uuid4())), 0, ids, logit_rows=logit_rows)


def test_a_window_is_a_streams_step_never_cut() -> None:
    window, prompt, decode = _work(20, 20), _work(100), _work(1)
    assert window.decode  # taken with the decode steps, first
    assert plan_step([window], budget=16) == [(window, 20)]  # alone: whole, past the budget
    plan = plan_step([decode, window, prompt], budget=64)
    assert plan[:2] == [(decode, 1), (window, 20)] and plan[2][0] is prompt
    # Beside decode steps that fill the budget it waits whole (oldest first next time).
    assert plan_step([decode, window], budget=16) == [(decode, 1)]
    assert plan_step([window, decode], budget=16) == [(window, 20)]


def ticket(session: str, position: int, rewind_from: int | None = None) -> Ticket:
    return Ticket(session=session, run=2, index=0, position=position, tokens=1,
                  fingerprint=b"", serial=9, rewind_from=rewind_from)  # fmt: skip


def test_a_rewind_drops_the_direct_returns_answers_from_its_position() -> None:
    drawn = DrawnAnswers(SessionTable(), 1.0)
    replies = {
        p: ActivationReply(WireHeaders(shape=(1, 1), dtype="int32"), b"x") for p in (3, 5, 8)
    }
    for position, reply in replies.items():
        drawn.publish("s", position, reply)
    drawn.rewound(ticket("s", 5))  # no rewind: nothing goes
    assert drawn._answers["s"] == replies
    drawn.rewound(ticket("s", 5, rewind_from=9))
    drawn.rewound(ticket("unknown", 0, rewind_from=4))
    assert drawn._answers["s"] == {3: replies[3]}


def test_the_answer_to_a_window_counts_its_accepted_drafts() -> None:
    """X-Meshnet-Accepted (§3.16): a window's n - 1, on the answer only; a
    plain sampled chunk's answer, and rows of logits, carry none."""
    window = WireHeaders(shape=(1, 4), dtype="int32", sample=GREEDY, draft=(5, 6, 7), position=3)
    assert window_accepted(window, (1, 3), "int32") == 2
    assert window_accepted(window, (4, 8), "float32") == 3  # logprobs rows: one per token
    assert window_accepted(window, (1, 4, VOCAB), "float32") is None  # broken rows as they are
    assert window_accepted(window.replace(draft=None), (1, 1), "int32") is None
    answer = outgoing_changes(window, (1, 1), "int32", "identity", 3, answer=True)
    assert answer["accepted"] == 0 and answer["draft"] is None
    down = outgoing_changes(window, (1, 4, 8), "float32", "identity", 3, answer=False)
    assert "accepted" not in down
    # Never sent down, whatever a hand-built request held.
    counted = window.replace(accepted=2)
    assert (
        outgoing_changes(counted, (1, 4), "int32", "identity", 3, answer=False)["accepted"] is None
    )
    relayed = WireHeaders(shape=(1, 2), dtype="int32", accepted=1, sample=GREEDY)
    assert relayed_headers(relayed).accepted == 1


# ------------------------------------------------------------------ over sockets


async def post(
    pool: DownstreamPool, session: str, key: str | None, chunk: np.ndarray, position: int,
    **fields: Any,
) -> ActivationResponse | ErrorResponse:  # fmt: skip
    """One run's only chunk of ``session`` at ``position`` (its answer as is)."""
    dtype, encoding, body = encode_for_wire(np.ascontiguousarray(chunk))
    headers = WireHeaders(shape=chunk.shape, dtype=dtype, session=session, chunk_index=0,
                          chunk_total=1, encoding=encoding, position=position,
                          session_key=key, **fields)  # fmt: skip
    return await pool.forward(headers, body, Deadline.after(60))


def answer_of(response: ActivationResponse | ErrorResponse) -> np.ndarray:
    assert isinstance(response, ActivationResponse), response.error  # type: ignore[union-attr]
    return np.array(decode_tensor(response.headers, response.body))


def accepted_of(response: ActivationResponse | ErrorResponse) -> int | None:
    assert isinstance(response, ActivationResponse), response.error  # type: ignore[union-attr]
    return response.headers.accepted


def error_of(response: ActivationResponse | ErrorResponse) -> tuple[int, str]:
    assert isinstance(response, ErrorResponse)
    return response.status, str(response.error["code"])


def ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray([tokens], np.int32)


async def metric(node: RunningNode, name: str) -> float:
    status, _, body = await exchange(node.url, http_request("GET", "/metrics"))
    assert status == 200
    (line,) = [ln for ln in body.decode().splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.anyio
async def test_a_window_is_verified_on_a_stub_whose_input_is_its_logits() -> None:
    async with chain([], []) as (entry, last):
        pool = DownstreamPool(entry.url)
        try:
            session = str(uuid.uuid4())
            logits = crafted([5, 6, 9, 1])  # drafts 5, 6, 7: two accepted, then 9
            answer = await post(pool, session, None, logits, 0, sample=GREEDY, draft=(5, 6, 7))
            assert answer_of(answer).tolist() == [[5, 6, 9]]
            assert answer.headers.draft is None and answer.headers.after is None
            # The count the last stage wrote, relayed up by the entry unchanged.
            assert accepted_of(answer) == 2
            again = await post(pool, session, None, logits, 0, sample=GREEDY, draft=(5, 6, 7))
            assert accepted_of(again) == 2  # replayed as kept
            plain = await post(pool, str(uuid.uuid4()), None, logits[0, :1], 0, sample=GREEDY)
            assert answer_of(plain).tolist() == [[5]] and accepted_of(plain) is None
            with_logprobs = SampleSpec(seed=1, temperature=0.0, logprobs=2)
            other = str(uuid.uuid4())
            rows = answer_of(await post(pool, other, None, logits, 0, sample=with_logprobs,
                                        draft=(5, 6, 9)))  # fmt: skip
            expected = [draw_answer(logits[:, i], with_logprobs, i + 1)[0] for i in range(4)]
            assert rows.dtype == np.float32 and np.array_equal(rows, np.stack(expected))
            assert np.array_equal(rows[:, 0], [5, 6, 9, 1])  # every draft, then the bonus
        finally:
            await pool.aclose()
        assert await metric(last, "meshnet_windows_verified_total") == 2
        assert await metric(last, "meshnet_window_drafted_tokens_total") == 6
        assert await metric(last, "meshnet_window_accepted_tokens_total") == 2 + 3
        assert await metric(entry, "meshnet_windows_verified_total") == 0  # it relayed them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=16)


@pytest.mark.anyio
async def test_drafts_that_are_not_the_windows_ids_are_400_at_the_first_stage(
    checkpoint: Path,
) -> None:
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        session = str(uuid.uuid4())
        refused = await post(pool, session, None, ids([9, 5, 7]), 0, sample=GREEDY, draft=(5, 6))
        assert error_of(refused) == (400, "bad_draft")
        assert [node.app.stage.calls for node in nodes] == [0, 0]
        assert session not in nodes[0].app.table
        # The same session starts cleanly with its ids as drafted.
        good = await post(pool, session, None, ids([9, 5, 6]), 0, sample=GREEDY, draft=(5, 6))
        assert 1 <= answer_of(good).shape[1] <= 3
        await pool.aclose()


@pytest.mark.anyio
async def test_a_rewind_into_an_attached_prefix_is_refused_and_changes_nothing(
    checkpoint: Path,
) -> None:
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 256, 40)]
    keys = prefix_block_keys(prompt)  # one block of 32
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        filer = str(uuid.uuid4())
        answer_of(await post(pool, filer, None, ids(prompt), 0, prefix_blocks=tuple(keys)))
        logits = {}
        for name in ("refused", "reference"):
            key = secrets.token_hex(16)
            session = str(uuid.uuid4())
            answer_of(await post(pool, session, key, ids(prompt[32:]), 32, prefix=keys[0]))
            if name == "refused":  # to 20, inside the 32 positions it attached
                rewind = await post(pool, session, key, ids([3]), 20, after=AfterSpec(40, 1))
                assert error_of(rewind) == (409, "rewind_refused")
                for node in nodes:
                    assert (node.app.table.position(session), node.app.table.epoch(session)) == (
                        40, 0)  # fmt: skip
                    assert node.app.stage.runner.cache_of(session).length == 40
            logits[name] = answer_of(await post(pool, session, key, ids([3, 4]), 40,
                                                after=AfterSpec(40, 0)))  # fmt: skip
        assert np.array_equal(logits["refused"], logits["reference"])
        await pool.aclose()


@pytest.mark.anyio
async def test_a_kv_export_carries_the_epoch_and_the_import_adopts_it(checkpoint: Path) -> None:
    async with (
        start_model_chain(checkpoint, [(0, 4)]) as (source,),
        start_model_chain(checkpoint, [(0, 4)]) as (target,),
    ):
        pools = DownstreamPool(source.url), DownstreamPool(target.url)
        session, key = str(uuid.uuid4()), secrets.token_hex(16)
        answer_of(await post(pools[0], session, key, ids([1, 2, 3, 4, 5, 6]), 0))
        rewound = await post(pools[0], session, key, ids([9]), 3, after=AfterSpec(6, 1))
        answer_of(rewound)
        assert (source.app.table.position(session), source.app.table.epoch(session)) == (4, 1)
        exported = await pools[0].fetch_kv(session, Deadline.after(20), key_headers(key))
        assert isinstance(exported, ActivationResponse)
        assert exported.headers.after == AfterSpec(4, 1)
        moved = {"with": str(uuid.uuid4()), "without": str(uuid.uuid4())}
        for name, after in (("with", exported.headers.after), ("without", None)):
            headers = exported.headers.replace(session=moved[name], session_key=key, after=after)
            response = await pools[1].request(
                "POST", "/forward?kv=1", Deadline.after(20), headers.to_pairs(),
                bytes(exported.body),
            )  # fmt: skip
            assert response.status == 200
        assert target.app.table.epoch(moved["with"]) == 1
        assert target.app.table.epoch(moved["without"]) == 0
        # The moved session goes on in its epoch: a successor of line 1 runs there.
        step = await post(pools[1], moved["with"], key, ids([7]), 4, after=AfterSpec(4, 1))
        assert np.array_equal(
            answer_of(step), answer_of(await post(pools[0], session, key, ids([7]), 4))
        )
        for pool in pools:
            await pool.aclose()


# ------------------------------------------------------------------ the real model

PROMPT = [1, 9690, 314, 253, 2914, 30, 1217, 260, 1743, 42, 33, 17, 5]
REAL_SPLITS = [(0, 15), (15, 30)]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rewound_session_goes_on_as_a_fresh_one_fed_the_kept_tokens() -> None:
    """Window [t, d1 … d4], rewind to keep t and d1, then x: the logits of x
    are those of a session that decoded t, d1 and x one token at a time."""
    window, x = [300, 11, 250, 7, 4000], 77
    kept = len(PROMPT) + 2
    async with start_model_chain(smollm2_gguf(), REAL_SPLITS) as nodes:
        pool = DownstreamPool(nodes[0].url)
        spec, plain = str(uuid.uuid4()), str(uuid.uuid4())
        for session in (spec, plain):
            answer_of(await post(pool, session, None, ids(PROMPT), 0))
        answer_of(await post(pool, spec, None, ids(window), len(PROMPT), sample=GREEDY,
                             draft=tuple(window[1:]), after=AfterSpec(len(PROMPT), 0)))  # fmt: skip
        end = len(PROMPT) + len(window)
        rewound = answer_of(await post(pool, spec, None, ids([x]), kept, after=AfterSpec(end, 1)))
        for i, token in enumerate(window[:2]):
            answer_of(await post(pool, plain, None, ids([token]), len(PROMPT) + i))
        fresh = answer_of(await post(pool, plain, None, ids([x]), kept))
        assert np.array_equal(rewound, fresh)
        for node in nodes:
            table = node.app.table
            assert (table.position(spec), table.epoch(spec)) == (kept + 1, 1)
            assert node.app.stage.runner.cache_of(spec).length == kept + 1
        await pool.aclose()


def _drafts(plain: list[int], at: int, k: int, wrong: int | None) -> list[int]:
    """The next ``k`` tokens of the plain run from ``at``, the ``wrong``-th changed."""
    drafts = list(plain[at : at + k])
    drafts += [0] * (k - len(drafts))
    if wrong is not None and wrong < len(drafts):
        drafts[wrong] = (drafts[wrong] + 1) % 49152
    return drafts


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_windows_of_drafts_some_wrong_give_the_plain_greedy_output() -> None:
    steps = 16
    async with start_model_chain(smollm2_gguf(), REAL_SPLITS) as nodes:
        pool = DownstreamPool(nodes[0].url)
        session = str(uuid.uuid4())
        plain = [int(answer_of(await post(pool, session, None, ids(PROMPT), 0,
                                          sample=GREEDY))[0, 0])]  # fmt: skip
        while len(plain) < steps:
            at = len(PROMPT) + len(plain) - 1
            step = await post(pool, session, None, ids(plain[-1:]), at, sample=GREEDY)
            plain.append(int(answer_of(step)[0, 0]))
        # Speculative: windows of 4 drafts from the plain run, some corrupted.
        spec = str(uuid.uuid4())
        out = [int(answer_of(await post(pool, spec, None, ids(PROMPT), 0,
                                        sample=GREEDY))[0, 0])]  # fmt: skip
        held, epoch, windows, rewinds = len(PROMPT), 0, 0, 0
        corruption = [1, None, 0, 3, None, 2, None, None]
        while len(out) < steps:
            at = len(PROMPT) + len(out) - 1  # where the last accepted token goes
            drafts = _drafts(plain, len(out), 4, corruption[windows % len(corruption)])
            if at < held:
                epoch, rewinds = epoch + 1, rewinds + 1
            answer = await post(pool, spec, None, ids([out[-1], *drafts]), at, sample=GREEDY,
                                draft=tuple(drafts), after=AfterSpec(held, epoch))  # fmt: skip
            tokens = answer_of(answer)[0].tolist()
            assert tokens[:-1] == drafts[: len(tokens) - 1]
            assert accepted_of(answer) == len(tokens) - 1
            out += tokens
            held, windows = at + len(drafts) + 1, windows + 1
        assert out[:steps] == plain
        assert windows < steps - 1 and rewinds >= 3  # windows saved steps; rewinds ran
        last = nodes[-1]
        assert await metric(last, "meshnet_windows_verified_total") == windows
        await pool.aclose()

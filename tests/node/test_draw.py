"""wire-2 §3.13 at the node: the node that answers draws the token.

Units first (``draw_answer``, ``check_sampled_head``), then real chains over
loopback: an echo stage's input is its "logits", so what the last node
answers can be held to ``meshnet_model.sampling``'s draw exactly.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pytest

from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_node.draw import check_sampled_head, draw_answer
from meshnet_proto import ActivationResponse, ProtocolError, WireHeaders
from meshnet_proto._codec import decode_tensor
from meshnet_proto.lowlevel import SampleSpec
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.wire import exchange, forward_request

from .test_chain import chain

VOCAB = 50
ROW = np.random.default_rng(7).standard_normal((1, VOCAB)).astype("<f4")


def reference(row: np.ndarray, spec: SampleSpec, position: int) -> int:
    params = SamplingParams(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p
    )
    return Sampler(params, spec.seed)(row[0], position)


# ------------------------------------------------------------------ units


def test_greedy_answers_the_argmax_as_int32() -> None:
    answer = draw_answer(ROW, SampleSpec(seed=1, temperature=0.0), 5)
    assert answer.dtype == np.int32 and answer.shape == (1, 1)
    assert int(answer[0, 0]) == int(np.argmax(ROW))


def test_a_seeded_draw_is_the_samplers_at_that_position() -> None:
    spec = SampleSpec(seed=99, temperature=1.5, top_k=30)
    drawn = [int(draw_answer(ROW, spec, p)[0, 0]) for p in range(40)]
    assert drawn == [reference(ROW, spec, p) for p in range(40)]
    assert len(set(drawn)) > 3  # the counter moves the draw
    assert drawn == [int(draw_answer(ROW, spec, p)[0, 0]) for p in range(40)]  # no state


def test_logprobs_come_as_id_logprob_pairs() -> None:
    spec = SampleSpec(seed=1, temperature=0.0, logprobs=3)
    answer = draw_answer(ROW, spec, 0)
    assert answer.dtype == np.float32 and answer.shape == (1, 8)
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=3), 1)
    token = sampler(ROW[0], 0)
    last = sampler.last
    assert last is not None
    expected = [token, last.logprob] + [v for pair in last.top for v in pair]
    np.testing.assert_allclose(answer[0], np.array(expected, dtype=np.float32))


def test_a_vocabulary_smaller_than_k_is_padded_with_id_minus_one() -> None:
    answer = draw_answer(ROW[:, :2], SampleSpec(seed=1, temperature=0.0, logprobs=4), 0)
    assert list(answer[0, 6::2]) == [-1.0, -1.0]


@pytest.mark.parametrize(
    "logits",
    [
        np.zeros((2, 5), dtype="<f4"),
        np.zeros((1, 2, 5), dtype="<f4"),
    ],
)
def test_what_cannot_be_drawn_from_is_400_bad_sample(logits: np.ndarray) -> None:
    with pytest.raises(ProtocolError) as caught:
        draw_answer(logits, SampleSpec(seed=0), 0)
    assert (caught.value.status, caught.value.code) == (400, "bad_sample")


def test_a_row_without_a_finite_logit_is_answered_as_it_is() -> None:
    """A broken stage's NaNs go up as logits: the sender's draw refuses them (502)."""
    broken = np.full((1, 5), np.nan, dtype="<f4")
    assert draw_answer(broken, SampleSpec(seed=0), 0) is broken


def test_the_head_check_refuses_a_stage_that_makes_hidden_states() -> None:
    check_sampled_head("logits")
    check_sampled_head("any")  # a stub: its output is checked once it ran
    with pytest.raises(ProtocolError) as caught:
        check_sampled_head("hidden")
    assert caught.value.code == "bad_sample"


# ------------------------------------------------------------------ over sockets


def sampled_fields(session: str, sample: str, shape: str = f"1,{VOCAB}") -> dict[str, str]:
    return {
        "X-Meshnet-Shape": shape,
        "X-Meshnet-Dtype": "float32",
        "X-Meshnet-Session": session,
        "X-Meshnet-Chunk-Index": "0",
        "X-Meshnet-Chunk-Total": "1",
        "X-Meshnet-Position": "0",
        "X-Meshnet-Sample": sample,
    }


@pytest.mark.anyio
async def test_a_two_node_chain_answers_the_drawn_token_and_replays_it() -> None:
    spec = SampleSpec(seed=1234, temperature=0.8, top_p=0.95)
    async with chain([], []) as (entry, last):
        pool = DownstreamPool(entry.url)
        try:
            session = str(uuid.uuid4())
            headers = WireHeaders(
                shape=(1, VOCAB),
                dtype="float32",
                session=session,
                chunk_index=0,
                chunk_total=1,
                position=0,
                sample=spec,
            )
            first = await pool.forward(headers, ROW.tobytes(), Deadline.after(20))
            again = await pool.forward(headers, ROW.tobytes(), Deadline.after(20))
        finally:
            await pool.aclose()
        assert isinstance(first, ActivationResponse) and isinstance(again, ActivationResponse)
        token = decode_tensor(first.headers, first.body)
        assert token.dtype == np.int32 and token.shape == (1, 1)
        # The drawn token's place: the chunk's position plus its tokens (a
        # rank-2 chunk's tokens are its axis 1: the echo's "logits" are VOCAB long).
        assert int(token[0, 0]) == reference(ROW, spec, VOCAB)
        assert first.headers.sample is None and first.headers.session == session
        assert again.body == first.body  # the retransmission: the kept answer
        assert len(first.body) == 4
        assert last.app.stage.calls == 1 and entry.app.stage.calls == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    "sample",
    [
        "seed=1,temperature=nan",
        "temperature=0.5",
        "seed=1,top_p=0",
        "seed=1,logprobs=21",
        "seed=1,beams=2",
        "seed=1,top_k=-3",
    ],
)
async def test_a_bad_sample_is_400_from_the_head_and_changes_nothing(sample: str) -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        status, _, body = await exchange(
            node.url, forward_request(sampled_fields(session, sample), ROW.tobytes())
        )
        error = json.loads(body)["error"]
        assert (status, error["code"], error["header"]) == (400, "bad_sample", "x-meshnet-sample")
        assert len(node.app.table) == 0 and node.app.stage.calls == 0
        # The node is up, and the same session starts cleanly afterwards.
        good = sampled_fields(session, "seed=1,temperature=0")
        status, headers, body = await exchange(node.url, forward_request(good, ROW.tobytes()))
        assert status == 200 and headers["x-meshnet-dtype"] == "int32"
        assert np.frombuffer(body, "<i4")[0] == np.argmax(ROW)
        assert "x-meshnet-sample" not in headers


@pytest.mark.anyio
async def test_a_stub_whose_output_is_no_logits_row_is_400_once_it_ran() -> None:
    """An echo's output is its input: a rank-3 chunk makes no row to draw from."""
    async with chain([]) as (node,):
        fields = sampled_fields(str(uuid.uuid4()), "seed=1", shape=f"1,2,{VOCAB // 2}")
        status, _, body = await exchange(node.url, forward_request(fields, ROW.tobytes()))
        assert (status, json.loads(body)["error"]["code"]) == (400, "bad_sample")
        health = await exchange(node.url, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert health.status == 200


@pytest.mark.anyio
async def test_a_seeded_draw_runs_off_the_loop_and_a_greedy_one_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    import meshnet_node.windows

    threads: list[int] = []
    real = meshnet_node.windows.sampled_answer  # draw_answer's (and a window's) caller

    def draw(*args: Any) -> np.ndarray:
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(meshnet_node.windows, "sampled_answer", draw)
    async with chain([]) as (node,):
        for sample in ("seed=1,temperature=0.7", "seed=1,temperature=0"):
            fields = sampled_fields(str(uuid.uuid4()), sample)
            answer = await exchange(node.url, forward_request(fields, ROW.tobytes()))
            assert answer.status == 200
    loop = threading.get_ident()
    assert threads[0] != loop and threads[1] == loop

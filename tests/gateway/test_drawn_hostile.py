"""A last stage that lies about the token it drew (wire-2 §3.13), over sockets.

The gateway's generation sends a sampled step to a scripted chain that
answers with a forged token: another session's answer, a negative id, an id
past the vocabulary, two ids, a logprobs row whose ids are not whole, a bare
id where logprobs were asked, ids as float logits of the wrong width. Each
is 502 ``downstream_bad_response`` naming the hop — never a 200 with a wrong
answer, never a 500 — and the gateway's next step on a sane chain works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import numpy as np
import pytest

from meshnet_gateway.openai.direct_return import DirectReturn, Relay
from meshnet_gateway.openai.drawn import Drawn, read_answer
from meshnet_gateway.openai.generation import ChainSession, ChainSettings, generate
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_proto import MeshnetError, WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import SampleSpec
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool
from support.openai import write_model_dir
from support.serving import scripted_peer

pytestmark = pytest.mark.anyio

# (what the answer's headers change, its tensor) from the request's headers.
Forge = Callable[[WireHeaders], tuple[dict[str, object], np.ndarray]]
# What GET /drawn/{session}?position=P answers: a token, or None (404).
Drawer = Callable[[str, int], np.ndarray | None]


def _forges() -> dict[str, Forge]:
    other = str(uuid.uuid4())
    return {
        "another session": lambda h: ({"session": other}, np.array([[5]], "<i4")),
        "negative id": lambda h: ({}, np.array([[-3]], "<i4")),
        "past the vocabulary": lambda h: ({}, np.array([[10_000]], "<i4")),
        "two ids": lambda h: ({}, np.array([[5, 6]], "<i4")),
        "two rows": lambda h: ({}, np.array([[5], [6]], "<i4")),
        "rank 3": lambda h: ({}, np.zeros((1, 1, 1), "<i4")),
        "another position": lambda h: ({"position": 999}, np.array([[5]], "<i4")),
    }


@asynccontextmanager
async def scripted_chain(forge: Forge, drawn: Drawer | None = None) -> AsyncIterator[str]:
    """One 'node' that reads each request whole and answers it with ``forge``;
    ``GET /drawn/{session}?position=P`` (wire-2 §3.14) with ``drawn``."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            buffer = b""
            # A client that closes its connection (after a 404, say) ends the loop.
            closed = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)
            with anyio.move_on_after(10), contextlib.suppress(*closed):
                while True:
                    while b"\r\n\r\n" not in buffer:
                        buffer += await stream.receive(65536)
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    lines = head.split(b"\r\n")[1:]
                    pairs = [tuple(x.strip() for x in line.split(b":", 1)) for line in lines]
                    length = int(dict((k.lower(), v) for k, v in pairs).get(b"content-length", 0))
                    while len(buffer) < length:
                        buffer += await stream.receive(65536)
                    buffer = buffer[length:]
                    if head.startswith(b"GET /drawn/"):
                        await stream.send(_drawn_answer(head, drawn))
                        continue
                    headers = parse_wire_headers(pairs)
                    changes, tensor = forge(headers)
                    answer = headers.replace(
                        shape=tensor.shape,
                        dtype="int32" if tensor.dtype.kind == "i" else "float32",
                        sample=None,
                        session_key=None,
                        stage=None,
                        deadline_ms=None,
                        **changes,
                    )
                    body = tensor.tobytes()
                    fields = b"".join(k + b": " + v + b"\r\n" for k, v in answer.to_pairs())
                    await stream.send(
                        b"HTTP/1.1 200 OK\r\n"
                        + fields
                        + b"Content-Length: %d\r\n\r\n" % len(body)
                        + body
                    )

    async with scripted_peer(handle) as url:
        yield url


def _drawn_answer(head: bytes, drawn: Drawer | None) -> bytes:
    target = head.split(b" ")[1].decode()
    session, _, query = target.removeprefix("/drawn/").partition("?")
    position = int(query.removeprefix("position="))
    tensor = None if drawn is None else drawn(session, position)
    if tensor is None:
        body = (
            b'{"error":{"status":404,"code":"not_found","message":"no","header":null,"hop":null}}'
        )
        return b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n" + (
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
    headers = WireHeaders(
        shape=tensor.shape,
        dtype="int32",
        session=session,
        chunk_index=0,
        chunk_total=1,
        position=position,
    )
    fields = b"".join(k + b": " + v + b"\r\n" for k, v in headers.to_pairs())
    body = tensor.tobytes()
    return b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: %d\r\n\r\n" % len(body) + body


SETTINGS = ChainSettings(
    chunk_tokens=64, inflight=1, encoding="identity", zstd_level=1, timeout=10.0
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer.load(write_model_dir(tmp_path_factory.mktemp("drawn") / "m"))


@pytest.mark.parametrize("name", list(_forges()))
async def test_a_forged_token_is_a_502_never_a_200(name: str, tokenizer: ModelTokenizer) -> None:
    async with scripted_chain(_forges()[name]) as url:
        pool = DownstreamPool(url)
        try:
            chain = ChainSession(pool, CodecPool(), SETTINGS)
            sampler = Sampler(SamplingParams(temperature=0.0), 1)
            with pytest.raises(MeshnetError) as caught:
                await generate(chain, tokenizer, [3, 4, 5], max_tokens=4, sampler=sampler)
        finally:
            await pool.aclose()
    assert (caught.value.status, caught.value.code) == (502, "downstream_bad_response")
    assert caught.value.hop == url


async def test_an_honest_scripted_chain_is_answered(tokenizer: ModelTokenizer) -> None:
    """The same script with an honest answer: the forges above fail for what they forge."""
    honest: Forge = lambda h: ({}, np.array([[7]], "<i4"))  # noqa: E731
    async with scripted_chain(honest) as url:
        pool = DownstreamPool(url)
        try:
            chain = ChainSession(pool, CodecPool(), SETTINGS)
            sampler = Sampler(SamplingParams(temperature=0.0), 1)
            result = await generate(chain, tokenizer, [3, 4, 5], max_tokens=4, sampler=sampler)
        finally:
            await pool.aclose()
    assert result.token_ids == [7, 7, 7, 7]


SPEC = SampleSpec(seed=1, temperature=0.0, logprobs=2)


@pytest.mark.parametrize(
    ("tensor", "sample"),
    [
        (np.array([[5.5, -0.1, 1.0, -1.0, 2.0, -2.0]], "<f4"), SPEC),  # a fractional id
        (np.array([[5.0, np.nan, 1.0, -1.0, 2.0, -2.0]], "<f4"), SPEC),  # a NaN logprob
        (np.array([[-2.0, -0.1, 1.0, -1.0, 2.0, -2.0]], "<f4"), SPEC),  # a negative id
        (np.array([[5]], "<i4"), SPEC),  # no logprobs where they were asked
        (np.array([[5, 6]], "<i4"), None),  # ints to a chunk that asked for logits
        (np.array([[-1]], "<i4"), SampleSpec(seed=1)),
    ],
)
def test_read_answer_refuses_what_is_no_token_nor_logits(
    tensor: np.ndarray, sample: SampleSpec | None
) -> None:
    with pytest.raises(MeshnetError) as caught:
        read_answer(tensor, sample, "http://hop")
    assert (caught.value.status, caught.value.code, caught.value.hop) == (
        502,
        "downstream_bad_response",
        "http://hop",
    )


def test_read_answer_takes_a_token_a_logprobs_row_and_logits() -> None:
    assert read_answer(np.array([[9]], "<i4"), SampleSpec(seed=1), "u") == Drawn(9)
    row = np.array([[4.0, -0.5, 4.0, -0.5, 1.0, -1.5]], "<f4")
    drawn = read_answer(row, SPEC, "u")
    assert isinstance(drawn, Drawn) and drawn.token == 4 and drawn.logprobs is not None
    assert drawn.logprobs.top == ((4, -0.5), (1, -1.5))
    padded = read_answer(np.array([[4.0, -0.5, 4.0, -0.5, -1.0, 0.0]], "<f4"), SPEC, "u")
    assert isinstance(padded, Drawn) and padded.logprobs is not None
    assert padded.logprobs.top == ((4, -0.5),)  # id -1: the vocabulary was smaller than k
    logits = read_answer(np.zeros((1, 300), "<f4"), SPEC, "u")  # a chain that ignored it
    assert isinstance(logits, np.ndarray) and logits.shape == (300,)


def test_every_stateless_request_the_api_takes_becomes_a_spec() -> None:
    """The API's ranges are the wire's, but for top_k (any int): a cut past
    2**31 is no cut, sent as 0 — the same draw."""
    from meshnet_gateway.openai.drawn import spec_for_last_stage

    def spec(sampler: Sampler) -> object:
        return anyio.run(spec_for_last_stage, sampler)

    huge = Sampler(SamplingParams(temperature=0.5, top_k=2**40), 3)
    drawn = spec(huge)
    assert isinstance(drawn, SampleSpec) and drawn.top_k == 0
    logits = np.random.default_rng(1).standard_normal(50)
    plain = Sampler(SamplingParams(temperature=0.5), 3)
    assert [huge(logits, p) for p in range(20)] == [plain(logits, p) for p in range(20)]
    assert spec(Sampler(SamplingParams(repetition_penalty=1.2), 3)) is None
    assert spec(Sampler(SamplingParams(), 10**19)) is None  # past the wire's seed


async def _direct_generation(
    drawn: Drawer, tokenizer: ModelTokenizer
) -> tuple[list[int] | MeshnetError, DirectReturn]:
    honest: Forge = lambda h: ({}, np.array([[7]], "<i4"))  # noqa: E731
    async with scripted_chain(honest, drawn) as url:
        pool, below = DownstreamPool(url), DownstreamPool(url)
        direct = DirectReturn(below, CodecPool(), worth_s=0.0)  # poll every step
        try:
            settings = dataclasses.replace(SETTINGS, direct=direct)
            chain = ChainSession(pool, CodecPool(), settings)
            sampler = Sampler(SamplingParams(temperature=0.0), 1)
            try:
                result = await generate(chain, tokenizer, [3, 4, 5], max_tokens=5, sampler=sampler)
            except MeshnetError as exc:  # caught here: the script's task group would wrap it
                return exc, direct
        finally:
            await pool.aclose()
            await direct.aclose()
    return result.token_ids, direct


async def test_the_direct_return_takes_the_polled_token_the_relay_agrees_with(
    tokenizer: ModelTokenizer,
) -> None:
    tokens, direct = await _direct_generation(lambda s, p: np.array([[7]], "<i4"), tokenizer)
    assert tokens == [7] * 5 and (direct.taken, direct.missed) == (4, 0)


async def test_a_poll_that_gets_no_token_falls_back_to_the_relayed_answer(
    tokenizer: ModelTokenizer,
) -> None:
    tokens, direct = await _direct_generation(lambda s, p: None, tokenizer)
    assert tokens == [7] * 5 and (direct.taken, direct.missed) == (0, 4)


async def test_a_polled_token_the_relay_contradicts_is_a_502(tokenizer: ModelTokenizer) -> None:
    error, _ = await _direct_generation(lambda s, p: np.array([[9]], "<i4"), tokenizer)
    assert isinstance(error, MeshnetError)
    assert (error.status, error.code) == (502, "downstream_bad_response")
    assert "another token" in str(error)


def test_a_relay_is_held_to_the_token_taken_early_whichever_lands_first() -> None:
    def agree(relayed: np.ndarray, early: np.ndarray) -> None:
        if relayed.tolist() != early.tolist():
            raise MeshnetError("differ", code="downstream_bad_response", status=502)

    first = Relay(agree)
    first.landed(np.array([[3]]))
    with pytest.raises(MeshnetError):
        first.took(np.array([[4]]))  # the relay came first: checked when taken
    second = Relay(agree)
    second.took(np.array([[4]]))
    with pytest.raises(MeshnetError):
        second.landed(np.array([[3]]))  # checked when it lands
    third = Relay(agree)
    third.took(np.array([[5]]))
    third.landed(np.array([[5]]))


def test_polling_stops_where_the_relay_is_as_quick_and_probes_again() -> None:
    """Loopback: the relayed answer lands as soon as the polled one, and a
    poll only adds work; one step in PROBE_EVERY still polls, and a lag
    that grows (a real link) turns polling back on."""
    from meshnet_gateway.openai.direct_return import PROBE_EVERY, WORTH_S

    direct = DirectReturn(DownstreamPool("http://127.0.0.1:9"), CodecPool())
    assert direct.worth_polling()  # nothing measured yet
    direct.observe_lag(0.0001)
    polled = [direct.worth_polling() for _ in range(2 * PROBE_EVERY)]
    assert polled.count(True) == 2 and direct.skipped == 2 * PROBE_EVERY - 2
    assert direct.worth_polling(probe=True)  # a generation's first step always polls
    direct.observe_lag(0.005)  # a probe on a link with a wifi's one-way delay
    assert direct.lag is not None and direct.lag >= WORTH_S and direct.worth_polling()
    direct.observe_lag(-1.0)  # the relay landed first: no lag, not a negative one
    assert direct.lag is not None and direct.lag >= 0

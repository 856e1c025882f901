"""wire-2 §3.14 at the node: ``GET /drawn/{session}?position=P``, over sockets.

An echo last stage answers a sampled float32 ``[1, 50]`` row with its argmax;
the poll answers the same 200 — before or after the chunk arrives — only to
the session's owner, and a stranger, a bad query, a wait that runs out or a
session that ends are 4xx with nothing changed and the node up.
"""

from __future__ import annotations

import json
import uuid

import anyio
import numpy as np
import pytest

from support.waiting import wait_until
from support.wire import Answer, exchange, forward_request, http_request

from .test_chain import chain

pytestmark = pytest.mark.anyio

VOCAB = 50
ROW = np.random.default_rng(3).standard_normal((1, VOCAB)).astype("<f4")
KEY = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


def sampled(session: str, position: int = 0, key: str | None = KEY) -> bytes:
    fields = {
        "X-Meshnet-Shape": f"1,{VOCAB}",
        "X-Meshnet-Dtype": "float32",
        "X-Meshnet-Session": session,
        "X-Meshnet-Chunk-Index": "0",
        "X-Meshnet-Chunk-Total": "1",
        "X-Meshnet-Position": str(position),
        "X-Meshnet-Sample": "seed=1,temperature=0",
    }
    if key is not None:
        fields["X-Meshnet-Session-Key"] = key
    return forward_request(fields, ROW.tobytes())


def poll(session: str, query: str = "position=0", key: str | None = KEY) -> bytes:
    fields = {} if key is None else {"X-Meshnet-Session-Key": key}
    return http_request("GET", f"/drawn/{session}?{query}", fields)


def code(answer: Answer) -> tuple[int, str]:
    return answer.status, json.loads(answer.body)["error"]["code"]


async def test_the_poll_answers_what_the_chunk_was_answered() -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        first = await exchange(node.url, sampled(session))
        polled = await exchange(node.url, poll(session))
        assert first.status == polled.status == 200
        assert polled.body == first.body and np.frombuffer(polled.body, "<i4")[0] == ROW.argmax()
        same = ("x-meshnet-session", "x-meshnet-position", "x-meshnet-shape", "x-meshnet-dtype")
        assert all(polled.headers[name] == first.headers[name] for name in same)


async def test_a_poll_sent_before_the_chunk_is_answered_once_it_is_drawn() -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        await exchange(node.url, sampled(session))  # the session exists: position 50 next
        got: list[Answer] = []

        async def early() -> None:
            got.append(await exchange(node.url, poll(session, "position=50")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(early)
            await wait_until(lambda: node.app.drawn.waiting, "the poll waiting at the node")
            answer = await exchange(node.url, sampled(session, position=50))
        assert answer.status == 200 and got[0].status == 200 and got[0].body == answer.body
        assert node.app.drawn.waiting == 0


@pytest.mark.parametrize(
    ("query", "key", "expected"),
    [
        ("position=0", OTHER, (403, "session_forbidden")),  # a stranger's key
        ("position=0", None, (403, "session_forbidden")),  # no key on a keyed session
        ("position=01", KEY, (400, "bad_request")),
        ("position=0&position=1", KEY, (400, "bad_request")),
        ("pos=0", KEY, (400, "bad_request")),
        ("", KEY, (400, "bad_request")),
    ],
)
async def test_a_stranger_or_a_bad_query_is_refused_and_changes_nothing(
    query: str, key: str | None, expected: tuple[int, str]
) -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        first = await exchange(node.url, sampled(session))
        assert code(await exchange(node.url, poll(session, query, key))) == expected
        assert node.app.drawn.waiting == 0
        again = await exchange(node.url, poll(session))  # the owner still gets it
        assert again.status == 200 and again.body == first.body


async def test_an_unknown_session_is_404() -> None:
    async with chain([]) as (node,):
        assert code(await exchange(node.url, poll(str(uuid.uuid4())))) == (404, "not_found")
        assert len(node.app.table) == 0 and node.app.drawn.waiting == 0


async def test_waits_are_bounded_in_time_and_in_number() -> None:
    async with chain(["--timeout", "0.5"]) as (node,):
        session = str(uuid.uuid4())
        await exchange(node.url, sampled(session))
        answers: list[Answer] = []

        async def wait_for(position: int) -> None:
            answers.append(await exchange(node.url, poll(session, f"position={position}")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for, 50)
            tg.start_soon(wait_for, 100)
            await wait_until(lambda: node.app.drawn.waiting == 2, "both polls waiting")
            # A third position is refused at once: at most two are waited on.
            third = await exchange(node.url, poll(session, "position=150"))
            assert code(third) == (404, "not_found") and len(answers) == 0
        assert [code(a) for a in answers] == [(404, "not_found")] * 2  # nobody drew them
        assert node.app.drawn.waiting == 0
        health = await exchange(node.url, http_request("GET", "/health"))
        assert health.status == 200


async def test_a_session_that_ends_wakes_its_poller() -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        await exchange(node.url, sampled(session))
        answers: list[Answer] = []

        async def wait() -> None:
            answers.append(await exchange(node.url, poll(session, "position=50")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await wait_until(lambda: node.app.drawn.waiting, "the poll waiting at the node")
            delete = http_request("DELETE", f"/sessions/{session}", {"X-Meshnet-Session-Key": KEY})
            assert (await exchange(node.url, delete)).status == 204
        assert code(answers[0]) == (404, "not_found") and node.app.drawn.waiting == 0


async def test_the_kept_answers_are_bounded_per_session() -> None:
    async with chain([]) as (node,):
        session = str(uuid.uuid4())
        for step in range(6):
            assert (await exchange(node.url, sampled(session, position=50 * step))).status == 200
        assert code(await exchange(node.url, poll(session, "position=0"))) == (404, "not_found")
        assert (await exchange(node.url, poll(session, "position=250"))).status == 200

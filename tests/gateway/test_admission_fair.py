"""Fair admission (issue 37): the queues take clients in turn, a long prompt
is granted the prefill budget piece by piece, and a chat's message count is
bounded before any of it is rendered.

``FairQueue`` and ``Admission`` as plain logic (round-robin across clients,
FIFO within one, cancellation), their waiting on trio with a mock clock
(timeouts in no real time) and on both loops with
``wait_all_tasks_blocked``; ``run_in_pieces``; and the /v1 surface over
loopback sockets with fake stages: another client's short prompt reaches
the chain between a long prompt's pieces, and a chat of 50,000 messages is
refused before its template is rendered while its text in one message is
served.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from trio.testing import MockClock

from meshnet_gateway.admission import Admission, AdmissionRefused, Grant, Ticket
from meshnet_gateway.fair_queue import FairQueue
from meshnet_gateway.openai.errors import OpenAIError
from meshnet_gateway.openai.limits import MAX_MESSAGES, PromptLimits
from meshnet_gateway.openai.pieces import run_in_pieces
from meshnet_node.backends import Stage
from support.openai import fake_embed, fake_stages, post_json, serve_openai, write_model_dir
from support.waiting import wait_until

LIMIT = 30  # every wait is bounded: a hang fails the test, not the run


def adm(running: int = 8, prefill: int = 100, queued: int = 16, timeout: float = 30.0) -> Admission:
    return Admission(max_running=running, max_prefill_tokens=prefill, max_queued=queued,
                     queue_timeout=timeout, clock=lambda: 0.0)  # fmt: skip


def mock_trio() -> Any:
    """Trio with a clock that jumps to the next deadline once every task is
    blocked: a 30 s queue timeout passes in no real time."""
    return pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mock")


# ---------------------------------------------------------------- FairQueue


def test_fair_queue_takes_clients_in_turn_and_each_in_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ["a1", "a2", "a3", "a4"]:
        queue.push("a", item)
    queue.push("b", "b1")
    queue.push(None, "n1")  # no client known: a lane like any other
    queue.push("b", "b2")
    assert (len(queue), queue.clients, queue.head()) == (7, 3, "a1")
    order = [queue.pop() for _ in range(4)]
    queue.push("c", "c1")  # a client arriving now joins at the back
    order += [queue.pop() for _ in range(len(queue))]
    assert order == ["a1", "b1", "n1", "a2", "b2", "a3", "c1", "a4"]
    assert not queue and queue.clients == 0
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(IndexError):
        queue.head()


def test_fair_queue_remove() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1")
    queue.push("b", "b1")
    queue.push("a", "a2")
    assert queue.remove("a", "a1") and not queue.remove("a", "a1")
    assert not queue.remove("z", "a2") and not queue.remove("b", "b9")
    assert queue.remove("b", "b1") and queue.clients == 1  # an emptied lane leaves
    assert [queue.pop() for _ in range(len(queue))] == ["a2"]


# ---------------------------------------------------------------- Admission, plain


def test_starts_are_round_robin_across_clients() -> None:
    admission = adm(running=1)
    held = admission.request(1, "a")
    assert isinstance(held, Ticket)
    waiters = {name: admission.request(1, name[0]) for name in ["a1", "a2", "a3", "b1"]}
    order: list[str] = []
    while len(order) < len(waiters):
        held.release()
        name = next(n for n, w in waiters.items() if n not in order and w.ticket is not None)
        order.append(name)
        held = waiters[name].ticket  # type: ignore[union-attr]
    # b came last but goes second: a's oldest, then b, then a's others in order.
    assert order == ["a1", "b1", "a2", "a3"]
    held.release()
    assert (admission.running, admission.queued) == (0, 0)


def test_one_client_holds_at_most_half_the_queue() -> None:
    admission = adm(running=1, queued=4)
    assert isinstance(admission.request(1, "a"), Ticket)
    admission.request(1, "a")
    admission.request(1, "a")
    with pytest.raises(AdmissionRefused) as caught:
        admission.request(1, "a")
    assert caught.value.reason == "queue_full" and "this client" in caught.value.message
    admission.request(1, "b")  # another client still finds a place
    admission.request(1, "c")
    with pytest.raises(AdmissionRefused) as caught:
        admission.request(1, "d")  # the whole queue is full now
    assert "at capacity" in caught.value.message
    assert adm(running=1, queued=1).request(1, "x") is not None


def test_prefill_pieces_are_round_robin_across_clients() -> None:
    admission = adm(prefill=10)
    first = admission.request_prefill(10, "long")
    assert isinstance(first, Grant)
    # The long prompt's next pieces were asked first; the short one after.
    longs = [admission.request_prefill(10, "long") for _ in range(3)]
    short = admission.request_prefill(3, "short")
    assert admission.prefill_waiting == 4
    first.release()  # one piece of the long prompt answered
    assert longs[0].grant is not None and short.grant is None  # its turn came first ...
    assert not isinstance(longs[0], Grant)
    longs[0].grant.release()
    assert short.grant is not None and longs[1].grant is None  # ... then the other client's
    short.grant.release()
    assert longs[1].grant is not None


def test_cancelled_pieces_and_starts_leave_their_lane() -> None:
    admission = adm(running=1, prefill=10)
    held, piece = admission.request(1, "a"), admission.request_prefill(10, "a")
    assert isinstance(held, Ticket) and isinstance(piece, Grant)
    start, waiting_piece = admission.request(1, "b"), admission.request_prefill(5, "b")
    assert not isinstance(start, Ticket) and not isinstance(waiting_piece, Grant)
    admission.cancel(start)
    admission.cancel(waiting_piece)
    assert (admission.queued, admission.prefill_waiting) == (0, 0)
    held.release()
    piece.release()
    assert (admission.running, admission.prefill_tokens, admission.prefill_grants) == (0, 0, 0)
    assert admission.describe()["prefill_waiting"] == 0


# ---------------------------------------------------------------- waiting


@pytest.mark.anyio
async def test_waiting_starts_are_served_in_turn_across_clients() -> None:
    admission = Admission(max_running=1, max_prefill_tokens=10, max_queued=16, queue_timeout=LIMIT)
    first = await admission.admit(1, client="a")
    order: list[str] = []

    async def wait(name: str, client: str) -> None:
        ticket = await admission.admit(1, client=client)
        order.append(name)
        await anyio.wait_all_tasks_blocked()
        ticket.release()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for name in ["a1", "a2", "a3", "b1", "c1", "b2"]:
                tg.start_soon(wait, name, name[0])
                await anyio.wait_all_tasks_blocked()
            assert admission.queued == 6 and admission.describe()["queued_clients"] == 3
            first.release()
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert (admission.running, admission.queued) == (0, 0)


@pytest.mark.anyio
async def test_a_short_prompt_is_granted_between_a_long_ones_pieces() -> None:
    admission = Admission(max_running=4, max_prefill_tokens=8, max_queued=4, queue_timeout=LIMIT)
    long_ticket = await admission.admit(80, client="a")
    short_ticket = await admission.admit(3, client="b")
    sent: list[tuple[str, int]] = []
    on_the_chain: list[anyio.Event] = []  # one per piece granted, set when it is answered

    async def run(who: str, ticket: Ticket, tokens: int, piece: int) -> None:
        for start in range(0, tokens, piece):
            grant = await ticket.prefill(min(piece, tokens - start))
            sent.append((who, grant.tokens))
            answered = anyio.Event()
            on_the_chain.append(answered)
            await answered.wait()
            grant.release()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "long", long_ticket, 80, 8)
            await anyio.wait_all_tasks_blocked()  # its first piece is on the chain
            tg.start_soon(run, "short", short_ticket, 3, 8)
            await anyio.wait_all_tasks_blocked()  # waits: the budget is in use
            assert sent == [("long", 8)] and admission.prefill_waiting == 1
            while on_the_chain:
                on_the_chain.pop(0).set()  # the oldest piece is answered
                await anyio.wait_all_tasks_blocked()
    assert sent[:3] == [("long", 8), ("short", 3), ("long", 8)], sent
    assert [who for who, _ in sent].count("long") == 10
    assert (admission.prefill_tokens, admission.prefill_grants) == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [mock_trio()])
async def test_a_piece_waiting_past_the_queue_timeout_is_refused() -> None:
    reasons: list[str] = []
    admission = Admission(max_running=4, max_prefill_tokens=8, max_queued=4, queue_timeout=30,
                          on_refused=reasons.append)  # fmt: skip
    ticket = await admission.admit(16, client="a")
    held = await ticket.prefill(8)
    started = anyio.current_time()
    with pytest.raises(AdmissionRefused) as caught:
        await ticket.prefill(8)
    assert caught.value.reason == "queue_timeout" and "prefill budget" in caught.value.message
    assert anyio.current_time() - started == pytest.approx(30)  # mock time: none really passed
    with pytest.raises(AdmissionRefused):
        await admission.prefill(8, client="b", timeout=1)  # the caller's own, shorter bound
    assert reasons == ["queue_timeout"] * 2
    assert (admission.prefill_waiting, admission.prefill_grants) == (0, 1)
    held.release()
    ticket.release()
    assert (admission.prefill_tokens, admission.running) == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [mock_trio()])
async def test_a_start_waiting_past_the_queue_timeout_is_refused_in_mock_time() -> None:
    admission = Admission(max_running=1, max_prefill_tokens=8, max_queued=4, queue_timeout=120)
    held = await admission.admit(1, client="a")
    started = anyio.current_time()
    with pytest.raises(AdmissionRefused) as caught:
        await admission.admit(1, client="b")
    assert caught.value.reason == "queue_timeout"
    assert anyio.current_time() - started == pytest.approx(120)
    assert caught.value.retry_after == 25  # 1 s moved a fifth of the way to the 120 s seen
    held.release()


@pytest.mark.anyio
async def test_a_piece_cancelled_while_waiting_or_just_granted_leaves_nothing() -> None:
    admission = Admission(max_running=4, max_prefill_tokens=8, max_queued=4, queue_timeout=LIMIT)
    ticket = await admission.admit(24, client="a")
    held = await ticket.prefill(8)

    async def caller() -> None:
        grant = await ticket.prefill(8)
        try:
            await anyio.sleep_forever()
        finally:
            grant.release()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            assert admission.prefill_waiting == 1
            tg.cancel_scope.cancel()  # the client left while its piece waited
        assert (admission.prefill_waiting, admission.prefill_tokens) == (0, 8)
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            held.release()  # grants the waiting piece and wakes it ...
            assert admission.prefill_tokens == 8 and admission.prefill_waiting == 0
            tg.cancel_scope.cancel()  # ... but it is cancelled before it runs
    assert (admission.prefill_tokens, admission.prefill_grants) == (0, 0)
    ticket.release()


# ---------------------------------------------------------------- run_in_pieces


@pytest.mark.anyio
async def test_run_in_pieces_cuts_the_prompt_and_places_attach_and_sample() -> None:
    gated: list[int] = []
    runs: list[tuple[list[int], str | None, object]] = []

    @asynccontextmanager
    async def gate(tokens: int) -> AsyncIterator[None]:
        gated.append(tokens)
        yield

    async def run(ids: np.ndarray, *, attach: str | None, sample: Any) -> Any:
        runs.append((ids[0].tolist(), attach, sample))
        return f"answer after {ids[0, -1]}"

    ids = np.arange(10, dtype=np.int32).reshape(1, 10)
    answer = await run_in_pieces(run, ids, 4, gate, "key", "draw")  # type: ignore[arg-type]
    assert answer == "answer after 9" and gated == [4, 4, 2]
    assert runs == [([0, 1, 2, 3], "key", None), ([4, 5, 6, 7], None, None),
                    ([8, 9], None, "draw")]  # fmt: skip


# ---------------------------------------------------------------- message count


class Untouchable:
    """A message that fails the test if anything looks inside it (in place
    of timing the check: counting is proved by what it never touched)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"message.{name} looked at")

    def __getitem__(self, key: object) -> Any:
        raise AssertionError(f"message[{key!r}] looked at")

    def __iter__(self) -> Any:
        raise AssertionError("message iterated")


def test_a_chats_messages_are_counted_before_anything_else() -> None:
    limits = PromptLimits.for_context(4096)
    assert limits.max_messages == MAX_MESSAGES == 2048
    messages = [Untouchable()] * 50_000  # a len(), whatever is inside: never looked at
    with pytest.raises(OpenAIError) as caught:
        limits.check_messages(messages)
    error = caught.value.body()["error"]
    assert (caught.value.status, error["code"], error["param"]) == (
        400, "array_above_max_length", "messages")  # fmt: skip
    assert "maximum length 2048" in error["message"] and "50000" in error["message"]
    limits.check_messages(messages[:2048])  # at the bound: fine
    limits.check_messages([{"role": "user", "content": "a" * 50_000}])  # the same text, one message
    limits.check_messages("not a list")  # left to the request's own checks
    assert PromptLimits.for_context(4096, 0, 3).max_messages == 3


# ---------------------------------------------------------------- over loopback


post = functools.partial(post_json, timeout=LIMIT)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    with anyio.fail_after(LIMIT):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))


@pytest.mark.anyio
async def test_a_short_prompt_reaches_the_chain_between_a_long_prompts_pieces(
    tmp_path: Path,
) -> None:
    """Before issue 37 the long prompt (over the whole budget) was admitted
    alone, and the short one's only chunk went after all of its chunks."""
    model_dir = write_model_dir(tmp_path / "tiny-model", context=256)
    seen: list[int] = []  # tokens of each chunk the first stage ran, in order

    def embed(tensor: np.ndarray) -> np.ndarray:
        seen.append(tensor.shape[1])
        return fake_embed(tensor)

    stages = [Stage("fake-embed", embed, delay_ms=20.0), fake_stages(2)[1]]
    flags = ["--chunk-tokens", "8", "--max-prefill-tokens", "8"]
    async with serve_openai(model_dir, stages=stages, gateway_flags=flags) as served:
        long = {"model": "tiny-model", "prompt": list(range(2, 82)), "max_tokens": 1}
        short = {"model": "tiny-model", "prompt": [5, 6, 7], "max_tokens": 1}
        async with anyio.create_task_group() as tg:
            tg.start_soon(in_thread, post, served.url, "/v1/completions", long)
            await wait_until(lambda: len(seen) >= 2, "the long prefill under way")
            status, _ = await in_thread(post, served.url, "/v1/completions", short)
            assert status == 200
        admission = served.gateway.admission
        assert (admission.running, admission.prefill_tokens, admission.prefill_waiting) == (0, 0, 0)
    assert sorted(seen) == [3] + [8] * 10, seen
    assert seen[seen.index(3) + 1 :].count(8) >= 5, seen  # most of the long one came after


@pytest.mark.anyio
async def test_a_chat_of_too_many_messages_is_refused_and_its_text_in_one_is_served(
    tmp_path: Path,
) -> None:
    model_dir = write_model_dir(tmp_path / "tiny-model", context=256)
    async with serve_openai(model_dir, stages=fake_stages(2),
                            gateway_flags=["--max-messages", "16"]) as served:  # fmt: skip
        url, path = served.url, "/v1/chat/completions"

        def chat(*contents: str) -> dict[str, Any]:
            messages = [{"role": "user", "content": text} for text in contents]
            return {"model": "tiny-model", "messages": messages, "max_tokens": 2}

        for count in (17, 50_000):
            status, body = await in_thread(post, url, path, chat(*["a"] * count))
            assert status == 400, body
            error = body["error"]
            assert (error["code"], error["param"], error["type"]) == (
                "array_above_max_length", "messages", "invalid_request_error")  # fmt: skip
            assert f"got an array with length {count}" in error["message"]
        status, body = await in_thread(post, url, path, chat("a" * 17))
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        status, body = await in_thread(post, url, path, chat(*["a"] * 16))  # at the bound
        assert status == 200, body

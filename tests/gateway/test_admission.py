"""The gateway's admission control (issue 19 item 4: admission, not timeouts).

``meshnet_gateway.admission.Admission`` as plain logic (budgets, strict
FIFO, the oversize-alone rule, refusals, a hypothesis state machine that
finds no leak), its waiting on trio and asyncio (timeouts, cancellation at
every point), the flags, and the /v1 surface over loopback sockets with a
slow fake chain: beyond capacity a request is answered 429/503 with
``Retry-After`` and OpenAI's error body before any chunk reaches a node.
"""

from __future__ import annotations

import functools
import http.client
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshnet_gateway.admission import Admission, AdmissionRefused, Grant, Ticket
from meshnet_gateway.config import GatewayConfig
from support.openai import Served, fake_stages, serve_openai, write_model_dir
from support.waiting import wait_until

LIMIT = 30  # every wait is bounded: a hang fails the test, not the run
T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(
    running: int = 4, prefill: int = 100, queued: int = 8, timeout: float = 30.0, **kw: Any
) -> Admission:
    return Admission(max_running=running, max_prefill_tokens=prefill, max_queued=queued,
                     queue_timeout=timeout, clock=kw.pop("clock", Clock()), **kw)  # fmt: skip


def granted(result: object) -> Ticket:
    assert isinstance(result, Ticket), result
    return result


def grant(result: object) -> Grant:
    assert isinstance(result, Grant), result
    return result


# ---------------------------------------------------------------- plain logic


def test_running_budget_queues_then_admits_on_release() -> None:
    adm = admission(running=2)
    first, second = granted(adm.request(1)), granted(adm.request(1))
    waiter = adm.request(1)
    assert not isinstance(waiter, Ticket) and adm.queued == 1 and adm.running == 2
    held = grant(adm.request_prefill(100))  # the prefill budget is not what holds it back
    held.release()
    assert waiter.ticket is None
    first.release()
    assert waiter.ticket is not None and adm.queued == 0 and adm.running == 2
    second.release()
    waiter.ticket.release()
    assert (adm.running, adm.prefill_tokens, adm.prefill_grants) == (0, 0, 0)


def test_a_prompt_takes_no_prefill_budget_until_its_pieces_ask() -> None:
    adm = admission(running=4, prefill=100)
    tickets = [granted(adm.request(5000)) for _ in range(3)]  # far over the budget: admitted
    assert adm.running == 3 and adm.prefill_tokens == 0
    for ticket in tickets:
        ticket.release()


def test_prefill_pieces_are_strict_at_the_head() -> None:
    adm = admission(prefill=100)
    big = grant(adm.request_prefill(60))
    middle = adm.request_prefill(50)  # 60 + 50 > 100
    small = adm.request_prefill(10)  # would fit, but must not pass the head
    assert not isinstance(middle, Grant) and not isinstance(small, Grant)
    assert small.grant is None and adm.prefill_waiting == 2
    big.release()  # its piece is answered: 60 tokens back
    assert middle.grant is not None and small.grant is not None
    assert adm.prefill_tokens == 60 and adm.prefill_grants == 2


def test_a_piece_over_the_whole_budget_goes_alone() -> None:
    adm = admission(prefill=100)
    huge = grant(adm.request_prefill(500))  # nothing else in flight: granted, not refused
    after = adm.request_prefill(1)
    assert not isinstance(after, Grant)
    huge.release()
    assert after.grant is not None
    # And it waits its turn behind others, then goes alone.
    adm2 = admission(prefill=100)
    small = grant(adm2.request_prefill(10))
    waiting = adm2.request_prefill(500)
    assert not isinstance(waiting, Grant)
    small.release()
    assert waiting.grant is not None and adm2.prefill_tokens == 500


def test_queue_full_is_refused_at_once_with_retry_after() -> None:
    reasons: list[str] = []
    adm = admission(running=1, queued=1, on_refused=reasons.append)
    granted(adm.request(1))
    adm.request(1)
    with pytest.raises(AdmissionRefused) as caught:
        adm.request(1)
    assert caught.value.reason == "queue_full" and caught.value.retry_after >= 1
    assert reasons == ["queue_full"] and adm.queued == 1 and adm.running == 1


def test_no_queue_at_all() -> None:
    adm = admission(running=1, queued=0)
    granted(adm.request(1))
    with pytest.raises(AdmissionRefused):
        adm.request(1)


def test_cancelling_the_head_lets_the_next_in() -> None:
    adm = admission(prefill=100)
    grant(adm.request_prefill(90))
    head = adm.request_prefill(50)
    behind = adm.request_prefill(5)
    assert not isinstance(head, Grant) and not isinstance(behind, Grant)
    adm.cancel(head)
    assert behind.grant is not None and adm.prefill_waiting == 0
    adm.cancel(head)  # twice: nothing
    assert adm.prefill_grants == 2
    adm.cancel(behind)  # served meanwhile: its grant goes back
    assert adm.prefill_tokens == 90


def test_releases_are_idempotent() -> None:
    adm = admission()
    ticket = granted(adm.request(7))
    piece = grant(adm.request_prefill(7))
    for _ in range(2):
        ticket.release()
        piece.release()
    assert (adm.running, adm.prefill_tokens, adm.prefill_grants) == (0, 0, 0)


def test_retry_after_follows_the_queue_wait() -> None:
    clock = Clock()
    waits: list[float] = []
    adm = admission(running=1, clock=clock, on_waited=waits.append)
    assert adm.retry_after() == 1
    for _ in range(20):
        ticket = granted(adm.request(1))
        waiter = adm.request(1)
        clock.now += 10.0
        ticket.release()
        assert waiter.ticket is not None  # type: ignore[union-attr]
        waiter.ticket.release()  # type: ignore[union-attr]
    assert waits == [10.0] * 20
    assert 8 <= adm.retry_after() <= 10


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError):
        admission(running=0)
    with pytest.raises(ValueError):
        admission(timeout=0)


class AdmissionMachine(RuleBasedStateMachine):
    """Random starts and pieces of three clients, releases and cancellations:
    the counts always equal what the live tickets and grants hold, the budgets
    hold, each client's waiters are served in their order, and when
    everything has ended nothing is left."""

    def __init__(self) -> None:
        super().__init__()
        self.adm = admission(running=3, prefill=50, queued=4)
        self.held: list[Ticket | Grant] = []
        self.waiters: list[Any] = []
        self.count = 0
        self.numbers: dict[int, tuple[str, bool, int]] = {}  # id(waiter): (client, piece, n)
        self.served: list[tuple[str, bool, int]] = []

    def _collect(self) -> None:
        for waiter in list(self.waiters):
            if waiter.granted is not None:
                self.waiters.remove(waiter)
                self.held.append(waiter.granted)
                self.served.append(self.numbers[id(waiter)])

    def _ask(self, tokens: int, client: str, piece: bool) -> None:
        self.count += 1
        try:
            ask = self.adm.request_prefill if piece else self.adm.request
            result = ask(tokens, client)
        except AdmissionRefused:
            # the whole queue is full, or this client holds half of it
            mine = sum(1 for w in self.waiters if self.numbers[id(w)][:2] == (client, False))
            full = self.adm.queued == self.adm.max_queued
            assert not piece and (full or mine >= self.adm.max_queued // 2)
            return
        if isinstance(result, (Ticket, Grant)):
            self.held.append(result)
        else:
            self.numbers[id(result)] = (client, piece, self.count)
            self.waiters.append(result)

    @rule(tokens=st.integers(0, 80), client=st.sampled_from("abc"), piece=st.booleans())
    def ask(self, tokens: int, client: str, piece: bool) -> None:
        self._ask(tokens, client, piece)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 100))
    def release(self, pick: int) -> None:
        self.held.pop(pick % len(self.held)).release()
        self._collect()

    @precondition(lambda self: self.waiters)
    @rule(pick=st.integers(0, 100))
    def cancel(self, pick: int) -> None:
        self.adm.cancel(self.waiters.pop(pick % len(self.waiters)))
        self._collect()

    @invariant()
    def counts_match_what_is_held(self) -> None:
        adm = self.adm
        live = [h for h in self.held if not h.released]
        tickets = [h for h in live if isinstance(h, Ticket)]
        grants = [h for h in live if isinstance(h, Grant)]
        assert adm.running == len(tickets) <= adm.max_running
        assert adm.prefill_grants == len(grants)
        assert adm.prefill_tokens == sum(g.tokens for g in grants)
        assert adm.prefill_grants <= 1 or adm.prefill_tokens <= adm.max_prefill_tokens
        starts = [w for w in self.waiters if not w.prefill]
        assert adm.queued == len(starts) <= adm.max_queued
        assert adm.prefill_waiting == len(self.waiters) - len(starts)
        # Nobody waits while the next in turn could go.
        assert not starts or adm.running == adm.max_running
        pieces = adm._prefill_queue
        assert not pieces or not adm.fits(pieces.head().tokens)
        # Within one client and queue, served in the order asked.
        for key in {(c, p) for c, p, _ in self.served}:
            numbers = [n for c, p, n in self.served if (c, p) == key]
            assert numbers == sorted(numbers)

    def teardown(self) -> None:
        for waiter in self.waiters:
            self.adm.cancel(waiter)
        for held in self.held:
            held.release()
        self._collect()
        for held in self.held:
            held.release()
        adm = self.adm
        assert (adm.running, adm.prefill_tokens, adm.queued, adm.prefill_waiting) == (0, 0, 0, 0)


AdmissionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)  # fmt: skip
test_admission_never_leaks = AdmissionMachine.TestCase


# ---------------------------------------------------------------- waiting


@pytest.mark.anyio
async def test_one_clients_waiters_are_admitted_in_fifo_order() -> None:
    adm = Admission(max_running=1, max_prefill_tokens=100, max_queued=8, queue_timeout=LIMIT)
    first = await adm.admit(1)
    admitted: list[int] = []

    async def wait(number: int, tokens: int) -> None:
        ticket = await adm.admit(tokens)
        admitted.append(number)
        await anyio.lowlevel.checkpoint()  # the others run while it holds its place
        ticket.release()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for number, tokens in enumerate([90, 1, 50, 1]):
                tg.start_soon(wait, number, tokens)
                await anyio.wait_all_tasks_blocked()
            assert adm.queued == 4
            first.release()
    assert admitted == [0, 1, 2, 3]
    assert (adm.running, adm.queued) == (0, 0)


@pytest.mark.anyio
async def test_queue_timeout_refuses_and_leaves_nothing() -> None:
    reasons: list[str] = []
    adm = Admission(max_running=1, max_prefill_tokens=100, max_queued=8, queue_timeout=0.05,
                    on_refused=reasons.append)  # fmt: skip
    held = await adm.admit(5)
    with anyio.fail_after(LIMIT), pytest.raises(AdmissionRefused) as caught:
        await adm.admit(5)
    assert caught.value.reason == "queue_timeout" and caught.value.retry_after >= 1
    assert reasons == ["queue_timeout"]
    with anyio.fail_after(LIMIT), pytest.raises(AdmissionRefused):
        await adm.admit(5, timeout=0.01)  # the caller's own, shorter bound
    assert (adm.running, adm.queued) == (1, 0)
    held.release()
    assert adm.running == 0


@pytest.mark.anyio
async def test_cancelled_while_queued_leaves_the_queue() -> None:
    adm = Admission(max_running=1, max_prefill_tokens=100, max_queued=8, queue_timeout=LIMIT)
    held = await adm.admit(5)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(adm.admit, 5)
            await anyio.wait_all_tasks_blocked()
            assert adm.queued == 1
            tg.cancel_scope.cancel()  # the client left
    assert (adm.queued, adm.running) == (0, 1)
    held.release()
    assert adm.running == 0


@pytest.mark.anyio
async def test_cancelled_in_the_tick_it_was_admitted_gives_the_ticket_back() -> None:
    adm = Admission(max_running=1, max_prefill_tokens=100, max_queued=8, queue_timeout=LIMIT)
    held = await adm.admit(5)

    async def caller() -> None:
        # As the API does: the ticket, once returned, is released in a finally
        # (on trio a wake-up beats the cancel, on asyncio the cancel wins:
        # either way the budget comes back).
        ticket = await adm.admit(7)
        try:
            await anyio.sleep_forever()
        finally:
            ticket.release()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            held.release()  # grants the waiter's ticket and wakes it ...
            assert adm.running == 1 and adm.queued == 0
            tg.cancel_scope.cancel()  # ... but it is cancelled before it runs
    assert (adm.queued, adm.running) == (0, 0)


@pytest.mark.anyio
async def test_a_stream_whose_producer_never_starts_gives_its_ticket_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from meshnet_gateway.openai import api

    monkeypatch.setattr(api, "STREAM_START_GRACE", 0.01)
    adm = Admission(max_running=2, max_prefill_tokens=100, max_queued=8, queue_timeout=LIMIT)
    lost, started = await adm.admit(5), await adm.admit(6)
    began = anyio.Event()
    began.set()  # this one's producer ran: its own finally releases it
    with anyio.fail_after(LIMIT):
        await api._reclaim_unstarted(lost, anyio.Event())
        await api._reclaim_unstarted(started, began)
    assert lost.released and not started.released
    assert adm.running == 1


# ---------------------------------------------------------------- flags


def test_flags_and_defaults() -> None:
    config = GatewayConfig.load(["--entry", "http://x:1"], {})
    assert (config.max_running, config.max_prefill_tokens, config.max_queued,
            config.queue_timeout) == (128, 4096, 128, 120.0)  # fmt: skip
    argv = ["--entry", "http://x:1", "--max-running", "2", "--max-prefill-tokens", "64",
            "--max-queued", "0", "--queue-timeout", "0.5"]  # fmt: skip
    config = GatewayConfig.load(argv, {"MESHNET_MAX_RUNNING": "9"})
    assert (config.max_running, config.max_prefill_tokens, config.max_queued,
            config.queue_timeout) == (2, 64, 0, 0.5)  # fmt: skip
    assert (
        GatewayConfig.load(["--entry", "http://x:1"], {"MESHNET_MAX_QUEUED": "3"}).max_queued == 3
    )
    assert GatewayConfig.load(["--entry", "http://x:1"], {}).max_messages == 2048
    assert (
        GatewayConfig.load(["--entry", "http://x:1", "--max-messages", "5"], {}).max_messages == 5
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--max-running", "0"], {}),
        (["--max-prefill-tokens", "-5"], {}),
        (["--max-queued", "many"], {}),
        (["--queue-timeout", "0"], {}),
        (["--queue-timeout", "inf"], {}),
        (["--max-messages", "0"], {}),
        ([], {"MESHNET_MAX_RUNNING": "x"}),
    ],
)
def test_bad_admission_flags_exit_2(
    argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        GatewayConfig.load(["--entry", "http://x:1", *argv], env)
    assert caught.value.code == 2
    assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------- over loopback


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-model", context=256)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    with anyio.fail_after(LIMIT):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))


def post(served: Served, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=LIMIT)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, response.read()
    finally:
        conn.close()


def sample(served: Served, name: str, **labels: str) -> float | None:
    return served.gateway.metrics.registry.get_sample_value(name, labels)


def slow_chain(delay_ms: float = 20.0) -> list[Any]:
    stages = fake_stages(2)
    stages[-1].delay_ms = delay_ms  # each decode step takes this long at the last stage
    return stages


async def settled(served: Served) -> None:
    admission = served.gateway.admission
    await wait_until(
        lambda: (
            not (
                admission.running
                or admission.queued
                or any(n.info()["sessions"] for n in served.nodes)
            )
        ),
        "the gateway and the nodes settled",
        timeout=LIMIT,
    )


@pytest.mark.anyio
async def test_beyond_capacity_is_429_with_retry_after_before_any_work(model_dir: Path) -> None:
    stages = slow_chain()
    # Plain decoding: one chain call per token, which the count below relies on.
    flags = ["--max-running", "2", "--max-queued", "1", "--speculate", "off"]
    async with serve_openai(model_dir, stages=stages, gateway_flags=flags) as served:
        results: list[tuple[int, dict[str, str], bytes]] = []

        async def one(stream: bool) -> None:
            body = {"model": "tiny-model", "prompt": "hello there", "max_tokens": 20,
                    "stream": stream}  # fmt: skip
            results.append(await in_thread(post, served, body))

        async with anyio.create_task_group() as tg:
            for index in range(5):
                tg.start_soon(one, index % 2 == 1)  # streamed ones are refused by status too
        statuses = sorted(status for status, _, _ in results)
        ok = statuses.count(200)
        assert 2 <= ok <= 3 and statuses.count(429) == 5 - ok, statuses
        for status, headers, body in results:
            if status == 429:
                assert int(headers["retry-after"]) >= 1
                error = json.loads(body)["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
            else:
                assert b"[DONE]" in body or json.loads(body)["usage"]["completion_tokens"] == 20
        refused = sample(served, "meshnet_openai_admission_refused_total", reason="queue_full")
        assert refused == 5 - ok
        # Refused before any work: only the admitted generations reached the chain.
        assert stages[0].calls == ok * 20  # one prefill and 19 decode steps each
        await settled(served)
        assert sample(served, "meshnet_openai_admission_running") == 0
        assert sample(served, "meshnet_openai_admission_prefill_tokens") == 0


@pytest.mark.anyio
async def test_a_request_waiting_too_long_is_503_with_retry_after(model_dir: Path) -> None:
    stages = slow_chain()
    flags = ["--max-running", "1", "--queue-timeout", "0.2"]
    async with serve_openai(model_dir, stages=stages, gateway_flags=flags) as served:
        long = {"model": "tiny-model", "prompt": "hello", "max_tokens": 40}
        short = {"model": "tiny-model", "prompt": "hi", "max_tokens": 2}
        async with anyio.create_task_group() as tg:
            first: list[int] = []

            async def hold() -> None:
                first.append((await in_thread(post, served, long))[0])

            tg.start_soon(hold)
            await wait_until(lambda: served.gateway.admission.running, "the long one running")
            calls = stages[0].calls
            status, headers, body = await in_thread(post, served, short)
            assert status == 503, body
            assert int(headers["retry-after"]) >= 1
            error = json.loads(body)["error"]
            assert (error["code"], error["type"]) == ("queue_timeout", "server_error")
            assert stages[0].calls - calls < 40  # the refused one added no chunk
        assert first == [200]
        assert sample(served, "meshnet_openai_admission_refused_total", reason="queue_timeout") == 1
        await settled(served)


@pytest.mark.anyio
async def test_a_client_leaving_the_queue_frees_its_place(model_dir: Path) -> None:
    stages = slow_chain()
    flags = ["--max-running", "1", "--max-queued", "1"]
    async with serve_openai(model_dir, stages=stages, gateway_flags=flags) as served:
        admission = served.gateway.admission
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "tiny-model", "prompt": "hi", "max_tokens": 40}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                   b"Content-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s") % (len(body), body)  # fmt: skip
        with anyio.fail_after(LIMIT):
            running = await anyio.connect_tcp(host, int(port))
            await running.send(request)
            await wait_until(lambda: admission.running, "the first one running")
            queued = await anyio.connect_tcp(host, int(port))
            await queued.send(request)
            await wait_until(lambda: admission.queued, "the second one queued")
            await queued.aclose()  # leaves while queued
            await wait_until(lambda: not admission.queued, "its place given up")
            assert admission.running == 1
            # Its place is free: another request queues instead of a 429.
            status, _, _ = await in_thread(post, served, json.loads(body))
            assert status == 200
            await running.aclose()
        await settled(served)
        assert (admission.running, admission.prefill_tokens, admission.queued) == (0, 0, 0)


def post_ids(url: str, ids: list[int]) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=LIMIT * 4)
    try:
        body = {"model": "tiny-model", "prompt": ids, "max_tokens": 4}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.anyio
# One loop (22 s a run): the admission it drives is loop-agnostic anyio code
# whose every rule runs on both loops in the tests above.
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_issues_burst_through_meshnet_run_with_its_defaults(tmp_path: Path) -> None:
    """Issue 19's acceptance, on the tiny model: ``meshnet run --stages 2``'s
    own code path and defaults; 16 concurrent 1,200-token prompts all
    answered, 64 each answered or refused with Retry-After, never 409/504,
    and the prefill budget held piece by piece (issue 37)."""
    from meshnet_cli.run import serve_local

    model = write_model_dir(tmp_path / "tiny-model", context=2048)
    prompts = [[2 + (7 * i + j) % 300 for j in range(1200)] for i in range(64)]
    threads = anyio.CapacityLimiter(64)
    async with serve_local(str(model), 2, gateway_flags=["--port", "0"]) as run:

        async def burst(count: int) -> list[tuple[int, dict[str, str], bytes]]:
            results: list[tuple[int, dict[str, str], bytes]] = []

            async def one(ids: list[int]) -> None:
                call = functools.partial(post_ids, run.url, ids)
                results.append(await anyio.to_thread.run_sync(call, limiter=threads))

            with anyio.fail_after(LIMIT * 8):
                async with anyio.create_task_group() as tg:
                    for ids in prompts[:count]:
                        tg.start_soon(one, ids)
            return results

        admission = run.gateway.admission
        peaks = {"prefill_tokens": 0, "prefill_waiting": 0}

        def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                for name in peaks:
                    peaks[name] = max(peaks[name], getattr(admission, name))
                return result

            return call

        # The two numbers change only in these (a grant or a place in the
        # queue, and the pump that serves the queue): their peaks as they
        # happen, not as a sampler on a loaded machine happens to see them.
        admission.request_prefill = recorded(admission.request_prefill)  # type: ignore[method-assign]
        admission._pump = recorded(admission._pump)  # type: ignore[method-assign]
        sixteen = await burst(16)
        assert [status for status, _, _ in sixteen] == [200] * 16
        for status, headers, body in await burst(64):
            assert status in (200, 429, 503), body
            if status != 200:
                assert int(headers["retry-after"]) >= 1
        # Issue 37: every prompt starts at once (--max-running 128), its
        # prefill in pieces of 128 tokens; 64 prefills want 8,192 tokens in
        # flight, the budget holds them to 4,096 and the rest wait their turn.
        assert 2048 < peaks["prefill_tokens"] <= 4096 and peaks["prefill_waiting"] > 0, peaks
        assert (admission.running, admission.prefill_tokens, admission.queued) == (0, 0, 0)

"""Faults (issue 6): lost responses, refused retries, a draining middle node,
a node killed and restarted, and sessions whose memory must come back.

In-process nodes and gateways over real loopback sockets, on trio and
asyncio; the killed node is a real process. ``tests/support/fault.py`` has
the proxy that loses requests and responses. Stages run ``--backend count``,
which counts its runs per (session, chunk index, position): "no stage runs a
chunk twice" is checked against those counts, not assumed.
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import anyio
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gateway import Client, RemoteError, open_gateway
from meshnet_gateway._retry import RetryPolicy
from meshnet_gateway.config import GatewayConfig
from meshnet_node import RunningNode, serve_node
from meshnet_node.backends import CountingStage
from meshnet_node.config import NodeConfig
from meshnet_proto import DownstreamError, ErrorResponse, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.fault import drop_first_attempts, fault_proxy
from support.gateway import QUIET, activation, same_bits, spawn, stop
from support.waiting import wait_until

LIMIT = 30  # every wait is bounded: a hang fails the test, never the run


def node_config(*flags: str):  # type: ignore[no-untyped-def]
    return NodeConfig.load([*QUIET, "--backend", "count", *flags])


def gateway_config(entry: str, *flags: str):  # type: ignore[no-untyped-def]
    return GatewayConfig.load([*QUIET, "--entry", entry, *flags])


def runs(node: RunningNode) -> Counter[object]:
    stage = node.app.stage
    assert isinstance(stage, CountingStage)
    return stage.runs


def metric(text: bytes, family: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name != family:
            continue
        for sample in fam.samples:
            counted = sample.name.endswith("_total") or sample.name == family
            if counted and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def chunk_keys(session: str, chunks: int, tokens: int) -> Counter[object]:
    return Counter({(session, k, k * tokens): 1 for k in range(chunks)})


async def forward_all(url: str, inputs: Sequence[np.ndarray], **kwargs: object) -> list[object]:
    """One concurrent gateway request per input; results in input order."""
    results: list[object] = [None] * len(inputs)
    errors: list[RemoteError] = []
    async with Client(url, max_connections=len(inputs)) as client:

        async def one(i: int) -> None:
            try:
                results[i] = await client.forward(inputs[i], encoding="identity", **kwargs)  # type: ignore[arg-type]
            except RemoteError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------ retry policy


def test_retry_policy_retries_only_what_is_safe() -> None:
    policy = RetryPolicy(retries=2, backoff=0.1)
    lost = DownstreamError("x", code="downstream_unreachable", hop="h")
    garbled = DownstreamError("x", code="downstream_bad_response", hop="h")
    spent = DownstreamError("x", code="downstream_timeout", status=504, hop="h")
    assert policy.retryable(lost)
    assert not policy.retryable(garbled) and not policy.retryable(spent)
    for status, retry in [(502, True), (503, True), (504, True), (400, False), (409, False),
                          (413, False), (500, False)]:  # fmt: skip
        assert policy.retryable(ErrorResponse(status=status, error={}, raw=b"")) is retry
    # Backoff doubles, with jitter in its upper half; Retry-After wins when longer.
    assert 0.05 <= policy.delay(1) <= 0.1 and 0.1 <= policy.delay(2) <= 0.2
    assert policy.delay(1, retry_after=1) == 1.0
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


# ------------------------------------------------------------------ lost responses


@contextlib.asynccontextmanager
async def lossy_chain(
    entry_drops: int, middle_drops: int, *gateway_flags: str
) -> AsyncIterator[tuple[RunningNode, RunningNode, str, object, object]]:
    """gateway → proxy → node 1 → proxy → node 2; each proxy loses the first
    ``*_drops`` responses of every chunk after the node has answered them."""
    async with contextlib.AsyncExitStack() as stack:
        enter = stack.enter_async_context
        last = await enter(serve_node(node_config()))
        middle = await enter(fault_proxy(last.url, drop_first_attempts(middle_drops)))
        first = await enter(serve_node(node_config("--next", middle.url)))
        entry = await enter(fault_proxy(first.url, drop_first_attempts(entry_drops)))
        gateway = await enter(open_gateway(gateway_config(entry.url, *gateway_flags)))
        yield first, last, gateway.url, entry, middle


@pytest.mark.anyio
async def test_lost_responses_are_retried_and_no_stage_runs_a_chunk_twice() -> None:
    """Every response of every chunk is lost twice between gateway and node 1
    and once between node 1 and node 2. The gateway retries; node 1 replays
    (or forwards its kept output again), node 2 replays; every output is
    bit-exact and each stage ran each (session, index, position) once."""
    flags = ["--retries", "3", "--retry-backoff-ms", "1", "--chunk-tokens", "4", "--inflight", "4"]
    inputs = [activation(32, 8, seed=100 + i) for i in range(4)]
    with anyio.fail_after(LIMIT):
        async with lossy_chain(2, 1, *flags) as (first, last, url, entry, middle):
            results = await forward_all(url, inputs)
            expected: Counter[object] = Counter()
            for array, result in zip(inputs, results, strict=True):
                assert same_bits(result.output, array)  # type: ignore[attr-defined]
                expected += chunk_keys(result.session, 8, 4)  # type: ignore[attr-defined]
            assert runs(first) == expected and runs(last) == expected
            assert entry.dropped["response"] == 2 * 32  # type: ignore[attr-defined]
            assert middle.dropped["response"] == 32  # type: ignore[attr-defined]
            async with Client(url) as client:
                text = (await client.pool.request("GET", "/metrics", Deadline.after(5))).body
            assert metric(text, "meshnet_chunks", outcome="retried") >= 32


@pytest.mark.anyio
async def test_without_retries_a_lost_response_is_a_502_naming_the_hop() -> None:
    with anyio.fail_after(LIMIT):
        async with lossy_chain(2, 0, "--retries", "0") as (first, _, url, entry, _m):
            with pytest.raises(RemoteError) as caught:
                await forward_all(url, [activation(8, 8)])
            err = caught.value
            assert (err.status, err.code, err.hop) == (502, "downstream_unreachable", entry.url)  # type: ignore[attr-defined]
            assert sum(runs(first).values()) == 1  # it ran; only the answer was lost


@pytest.mark.anyio
async def test_a_4xx_is_never_retried() -> None:
    """A chunk over the node's tensor limit: 413 once, not three times."""
    with anyio.fail_after(LIMIT):
        async with contextlib.AsyncExitStack() as stack:
            node = await stack.enter_async_context(
                serve_node(node_config("--max-tensor-bytes", "1024"))
            )
            gateway = await stack.enter_async_context(
                open_gateway(gateway_config(node.url, "--retries", "3", "--retry-backoff-ms", "1"))
            )
            with pytest.raises(RemoteError) as caught:
                await forward_all(gateway.url, [activation(64, 64)])
            assert caught.value.status == 413
            text = node.app.metrics.render()
            assert metric(text, "meshnet_requests", status="413") == 1  # one answer: no retry


# ------------------------------------------------------------------ graceful shutdown


@pytest.mark.anyio
async def test_draining_middle_node_finishes_in_flight_chunks_and_503s_new_ones() -> None:
    """Node 1 of gateway → node 1 → node 2 is asked to shut down while three
    chunks are inside node 2's (slow) stage: all three answers arrive whole and
    bit-exact, a new request to node 1 meanwhile gets 503 shutting_down with
    Retry-After, node 2 saw no half-sent request, and once drained node 1 is
    gone: the gateway names it in a 502."""
    inputs = [activation(4, 16, seed=200 + i) for i in range(3)]
    finished = False
    with anyio.fail_after(LIMIT):
        async with contextlib.AsyncExitStack() as stack:
            enter = stack.enter_async_context
            last = await enter(serve_node(node_config("--delay-ms", "600")))
            middle = await enter(serve_node(node_config("--next", last.url)))
            gateway = await enter(
                open_gateway(
                    gateway_config(middle.url, "--retries", "1", "--retry-backoff-ms", "1")
                )
            )
            results: list[object] = []

            async def in_flight() -> None:
                results.extend(await forward_all(gateway.url, inputs))

            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight)
                await wait_until(lambda: last.app.stage.calls >= 3, "three chunks at the last node")
                middle.server.request_shutdown()
                pool = DownstreamPool(middle.url)
                headers = WireHeaders(shape=(1, 4, 16), dtype="bfloat16",
                                      session="0" * 8 + "-0000-4000-8000-" + "0" * 12,
                                      chunk_index=0, chunk_total=1, position=0)  # fmt: skip
                refused = await pool.forward(headers, bytes(128), Deadline.after(5))
                await pool.aclose()
                assert isinstance(refused, ErrorResponse)
                assert (refused.status, refused.error["code"]) == (503, "shutting_down")
                assert refused.retry_after == 1
            for array, result in zip(inputs, results, strict=True):
                assert same_bits(result.output, array)  # type: ignore[attr-defined]
            text = last.app.metrics.render()
            assert metric(text, "meshnet_requests", endpoint="/forward", status="200") == 3
            assert sum(runs(last).values()) == 3  # no other request reached node 2
            with pytest.raises(RemoteError) as caught:
                await forward_all(gateway.url, inputs[:1])
            assert (caught.value.status, caught.value.hop) == (502, middle.url)
            finished = True
        assert finished  # the block ran to its end (was not cancelled out of)


# ------------------------------------------------------------------ session memory


def _held() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", ["trio"]
)  # memory of the core's table: one loop is enough
async def test_delete_ttl_and_eviction_give_session_memory_back() -> None:
    """16 sessions each leave a 256 KiB answer stored for replay at the last
    node. Measured with tracemalloc (numpy reports its buffers to it): the
    stored answers hold ~4 MiB; DELETE gives it back; so does the idle TTL;
    and with a 1 MiB stored-bytes budget the evicted answers never pile up."""
    sessions, tokens, hidden = 16, 256, 512  # bfloat16: 256 KiB a chunk
    stored = sessions * tokens * hidden * 2
    inputs = [activation(tokens, hidden, seed=300 + i) for i in range(sessions)]
    ids = [f"{i:08x}-0000-4000-8000-{i:012x}" for i in range(sessions)]

    async def fill(url: str) -> DownstreamPool:
        pool = DownstreamPool(url, max_connections=4)
        for sid, array in zip(ids, inputs, strict=True):
            headers = WireHeaders(shape=array.shape, dtype="bfloat16", session=sid,
                                  chunk_index=0, chunk_total=1, position=0)  # fmt: skip
            response = await pool.forward(headers, array.tobytes(), Deadline.after(10))
            assert not isinstance(response, ErrorResponse), response
            del response
        return pool

    tracemalloc.start()
    try:
        with anyio.fail_after(LIMIT):
            # DELETE
            async with serve_node(node_config("--backend", "echo")) as node:
                before = _held()
                pool = await fill(node.url)
                grown = _held() - before
                assert node.app.table.stored_bytes == stored
                assert grown >= 0.9 * stored, grown
                for sid in ids:
                    gone = await pool.request("DELETE", f"/sessions/{sid}", Deadline.after(5))
                    assert gone.status == 204
                await pool.aclose()
                assert len(node.app.table) == 0 and node.app.table.stored_bytes == 0
                assert _held() - before < 0.1 * stored
            # idle TTL (the node's own expiry loop, every ttl/4)
            async with serve_node(node_config("--backend", "echo", "--session-ttl", "2")) as node:
                before = _held()
                pool = await fill(node.url)
                await pool.aclose()
                # (On a slow machine some may have expired already: what is
                # held must still match what the table counts.)
                held = node.app.table.stored_bytes
                assert held >= tokens * hidden * 2 and _held() - before >= 0.9 * held
                await wait_until(lambda: not len(node.app.table), "every session expired")
                assert node.app.table.stored_bytes == 0
                assert _held() - before < 0.1 * stored
            # eviction under the stored-bytes budget
            budget = 1024 * 1024
            async with serve_node(
                node_config("--backend", "echo", "--max-stored-bytes", str(budget))
            ) as node:
                before = _held()
                pool = await fill(node.url)
                await pool.aclose()
                assert len(node.app.table) == sessions  # the sessions stay, their answers go
                assert node.app.table.stored_bytes <= budget
                assert _held() - before < budget + 0.1 * stored
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ a killed node


def test_node_killed_mid_session_then_restarted_on_its_port() -> None:
    """gateway A → node A → shared last node; gateway B → shared last node.

    Node A is killed while a request of session S is inside it: gateway A
    answers 502 naming node A (after its retries, within its timeout);
    sessions on gateway B, which shares the last node, go on bit-exact
    throughout. Node A restarts on the same port and gateway A serves new
    sessions with nothing else restarted."""
    procs = []
    try:
        last, last_url = spawn("meshnet_node", "--backend", "count")
        procs.append(last)
        node_a, a_url = spawn("meshnet_node", "--next", last_url, "--delay-ms", "300")
        procs.append(node_a)
        flags = ["--timeout", "10", "--chunk-tokens", "4", "--retry-backoff-ms", "20"]
        gw_a, gw_a_url = spawn("meshnet_gateway", "--entry", a_url, *flags)
        procs.append(gw_a)
        gw_b, gw_b_url = spawn("meshnet_gateway", "--entry", last_url, *flags)
        procs.append(gw_b)

        async def drive() -> None:
            healthy_ok = 0

            async def healthy(stop_at: anyio.Event) -> None:
                nonlocal healthy_ok
                async with Client(gw_b_url) as client:
                    seed = 0
                    while not stop_at.is_set() and seed < 400:  # bounded
                        seed += 1
                        array = activation(16, 8, seed=1000 + seed)
                        result = await client.forward(array, encoding="identity")
                        assert same_bits(result.output, array)
                        healthy_ok += 1

            with anyio.fail_after(LIMIT + 15):
                async with Client(gw_a_url) as client:
                    first = await client.forward(activation(8, 8, seed=1), encoding="identity")
                    done = anyio.Event()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(healthy, done)
                        # Session S's second request: 8 chunks, 300 ms each at node A.
                        caught: list[RemoteError] = []

                        async def second() -> None:
                            try:
                                await client.forward(
                                    activation(32, 8, seed=2),
                                    session=first.session,
                                    encoding="identity",
                                )
                            except RemoteError as exc:
                                caught.append(exc)

                        tg.start_soon(second)
                        at_a = DownstreamPool(a_url)

                        async def under_way() -> bool:  # a chunk into it at node A
                            answer = await at_a.request("GET", "/metrics", Deadline.after(5))
                            return metric(answer.body, "meshnet_chunks", outcome="processed") >= 3

                        await wait_until(under_way, "the second request under way", every=0.05)
                        await at_a.aclose()
                        node_a.kill()
                        node_a.wait()
                        await wait_until(lambda: caught, "the second request's error")
                        done.set()
                    err = caught[0]
                    assert err.status in (502, 504) and err.hop == a_url, err
                    assert healthy_ok > 0
                    # Node A comes back on its port; gateway A was not touched.
                    port = a_url.rsplit(":", 1)[1]
                    procs.append(spawn("meshnet_node", "--next", last_url, "--port", port)[0])
                    for seed in (3, 4):
                        array = activation(32, 8, seed=seed)
                        result = await client.forward(array, encoding="identity")
                        assert same_bits(result.output, array) and result.position == 0

        anyio.run(drive, backend="trio")
        assert stop(gw_a) == 0 and stop(gw_b) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _table_churn(table: object, sessions: int, runs: int) -> None:
    """``sessions`` sessions, each ``runs`` one-chunk runs with a stored answer."""
    from meshnet_proto import Process, SessionTable

    assert isinstance(table, SessionTable)
    for i in range(sessions):
        sid = f"{i:08x}-0000-4000-8000-{i:012x}"
        for run in range(runs):
            headers = WireHeaders(shape=(1, 1, 4), dtype="float32", session=sid,
                                  chunk_index=0, chunk_total=1, position=run)  # fmt: skip
            decision = table.offer(headers, f"{i}-{run}".encode().ljust(16), 0.0)
            assert isinstance(decision, Process)
            table.stage_done(decision.ticket, None, 0.0)
            table.response_ready(decision.ticket, b"answer", 0.0, nbytes=64)
        table.end_session(sid)


def test_ended_sessions_and_finished_runs_leave_nothing_in_the_stored_bytes_ledger() -> None:
    """Found by the soak: every stored answer left a ledger entry behind after
    its session ended (or its run was replaced) until a lazy purge, which the
    default 1 GiB budget postponed for hundreds of thousands of answers.
    Measured: 2 000 more answers in ended sessions cost the table nothing."""
    from meshnet_proto import Limits, SessionTable

    table = SessionTable(Limits(max_sessions=2000))
    tracemalloc.start()
    try:
        _table_churn(table, 200, 2)  # warm-up: dict sizes, interned strings
        before = _held()
        _table_churn(table, 500, 4)
        grown = _held() - before
    finally:
        tracemalloc.stop()
    assert len(table) == 0 and table.stored_bytes == 0
    assert grown < 64 * 1024, grown  # was ~500 KiB (~250 B per answer) before the fix
    # Live answers are never purged: 1100 sessions kept open pass the
    # ledger's first purge point (1024 entries) and all stay counted.
    for i in range(1100):
        sid = f"{i:08x}-0000-4000-8000-{i:012x}"
        headers = WireHeaders(shape=(1, 1, 4), dtype="float32", session=sid,
                              chunk_index=0, chunk_total=1, position=0)  # fmt: skip
        decision = table.offer(headers, str(i).encode().ljust(16), 0.0)
        table.stage_done(decision.ticket, None, 0.0)  # type: ignore[union-attr]
        table.response_ready(decision.ticket, b"answer", 0.0, nbytes=64)  # type: ignore[union-attr]
    assert len(table) == 1100 and table.stored_bytes == 1100 * 64


def test_a_reforwarded_chunk_is_counted_once_in_the_stored_bytes_ledger() -> None:
    """Forward failed (output kept: counted), retransmitted (reforwarded),
    answered: the answer is counted — not the answer plus the output it
    replaced, which used to stay on the books until a lazy purge."""
    from meshnet_proto import Process, Reforward, SessionTable

    table = SessionTable()
    sid = "00000000-0000-4000-8000-000000000001"
    headers = WireHeaders(shape=(1, 1, 4), dtype="float32", session=sid,
                          chunk_index=0, chunk_total=1, position=0)  # fmt: skip
    fingerprint = b"f" * 16
    first = table.offer(headers, fingerprint, 0.0)
    assert isinstance(first, Process)
    table.stage_done(first.ticket, "output", 0.0)
    table.forward_failed(first.ticket, 0.0, nbytes=1000)
    assert table.stored_bytes == 1000
    again = table.offer(headers, fingerprint, 0.0)
    assert isinstance(again, Reforward)
    table.response_ready(again.ticket, b"answer", 0.0, nbytes=300)
    assert table.stored_bytes == 300  # was 1300 (nothing read the ledger in between)

"""What a KV move may make a node hold (wire-2 §3.11; issue 37, part 4): the
transfer places, the import's body deadline, the export's copy in the
in-flight budget, the refusal of non-finite KV, and the flags.

The node tests run a model node in this process over real loopback
sockets, on trio and asyncio; peers are told apart by the loopback address
they connect from (127.0.0.x).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import ml_dtypes
import numpy as np
import pytest

from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node import RunningNode, serve_node
from meshnet_node.config import NodeConfig
from meshnet_node.kv_transfers import KVTransfers, check_finite
from meshnet_proto import CapacityError, ProtocolError
from meshnet_proto.lowlevel import kv_checksum
from support.waiting import wait_until

KEY = "0123456789abcdef0123456789abcdef"
# 4 layers x 2 x 4 KV heads x 64 x float32: 8 KiB a position; 2,048 positions
# are 16 MiB, more than loopback's socket buffers take from an unread answer.
LAYOUT = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
POSITIONS = 2048


# -- the parts, alone ---------------------------------------------------------------------


def test_transfers_are_bounded_per_peer_and_in_all() -> None:
    transfers = KVTransfers(3, 2)
    a1, a2 = transfers.take("a", "x"), transfers.take("a", "x")
    with pytest.raises(CapacityError) as full:
        transfers.take("a", "GET /kv/s")
    assert (full.value.code, full.value.status, full.value.retry_after) == (
        "kv_transfers_full",
        503,
        2,
    )
    assert "this peer holds 2 of its 2" in str(full.value)
    b1 = transfers.take("b", "x")
    with pytest.raises(CapacityError, match="3 of this node's 3 are open"):
        transfers.take("c", "x")
    a1()
    a1()  # idempotent: a cleanup may run twice
    assert transfers.describe() == {"open": 2, "max": 3, "max_per_peer": 2}
    c1 = transfers.take("c", "x")
    for place in (a2, b1, c1):
        place()
    assert transfers.open == 0 and not transfers._by_peer  # nothing left per peer
    with pytest.raises(ValueError):
        KVTransfers(0, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_kv_with_nan_or_infinity_is_bad_kv(dtype: type, bad: float) -> None:
    kv = np.ones((1, 2, 1, 1, 4, 2), dtype)
    check_finite(kv)
    kv[0, 1, 0, 0, 3, 1] = bad
    with pytest.raises(ProtocolError) as refused:
        check_finite(kv)
    assert (refused.value.code, refused.value.status) == ("bad_kv", 400)


def test_the_finite_check_covers_a_kv_larger_than_its_slice() -> None:
    kv = np.zeros(9 * 1024 * 1024 + 5, np.float32)
    check_finite(kv)
    kv[-1] = np.nan
    with pytest.raises(ProtocolError):
        check_finite(kv)
    check_finite(np.arange(4, dtype=np.int32))  # not a float: nothing to check


def test_the_flags_their_defaults_and_environment() -> None:
    default = NodeConfig.load([], {})
    assert (
        default.kv_import_timeout,
        default.max_kv_transfers,
        default.max_kv_transfers_per_peer,
    ) == (10.0, 4, 2)
    env = {"MESHNET_KV_IMPORT_TIMEOUT": "2.5", "MESHNET_MAX_KV_TRANSFERS": "8"}
    config = NodeConfig.load(["--max-kv-transfers-per-peer", "3"], env)
    assert (
        config.kv_import_timeout,
        config.max_kv_transfers,
        config.max_kv_transfers_per_peer,
    ) == (2.5, 8, 3)
    usage = NodeConfig.build_parser().format_help()
    for flag in ("--kv-import-timeout", "--max-kv-transfers", "--max-kv-transfers-per-peer"):
        assert flag in usage
    for bad in (["--kv-import-timeout", "0"], ["--max-kv-transfers", "0"]):
        with pytest.raises(SystemExit):
            NodeConfig.load(bad, {})


# -- a model node ---------------------------------------------------------------------------

anyio_test = pytest.mark.anyio


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("kv-budgets") / "model"
    write_checkpoint(path, small_config(**LAYOUT), seed=3)
    return str(path)


@asynccontextmanager
async def _node(checkpoint: str, *args: str) -> AsyncIterator[RunningNode]:
    flags = ["--port", "0", "--log-level", "warning", "--model", checkpoint, *args]
    async with serve_node(NodeConfig.load(flags, {})) as running:
        yield running


def _kv(positions: int) -> np.ndarray:
    shape = (4, 2, 1, 4, positions, 64)
    return np.random.default_rng(positions).standard_normal(shape, dtype=np.float32)


def _import_head(node: RunningNode, session: str, kv: np.ndarray, *, expect: bool) -> bytes:
    lines = [
        "POST /forward?kv=1 HTTP/1.1",
        "Host: node",
        "Content-Type: application/octet-stream",
        "X-Meshnet-Wire: 2",
        f"X-Meshnet-Shape: {','.join(map(str, kv.shape))}",
        "X-Meshnet-Dtype: float32",
        f"X-Meshnet-Session: {session}",
        "X-Meshnet-Chunk-Index: 0",
        "X-Meshnet-Chunk-Total: 1",
        f"X-Meshnet-Position: {kv.shape[4]}",
        f"X-Meshnet-KV-Checksum: {kv_checksum(kv)}",
        f"X-Meshnet-KV-Fingerprint: {node.app.identity['fingerprint']}",
        f"X-Meshnet-Session-Key: {KEY}",
        f"Content-Length: {kv.nbytes}",
    ]
    if expect:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _export_head(session: str) -> bytes:
    return (
        f"GET /kv/{session} HTTP/1.1\r\nHost: node\r\nX-Meshnet-Session-Key: {KEY}\r\n\r\n".encode()
    )


async def _connect(node: RunningNode, peer: str, data: bytes) -> anyio.abc.SocketStream:
    host, port = node.url.removeprefix("http://").rsplit(":", 1)
    stream = await anyio.connect_tcp(host, int(port), local_host=peer)
    await stream.send(data)
    return stream


async def _answer_head(stream: anyio.abc.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and whatever body bytes came with them."""
    raw = b""
    with anyio.fail_after(30):
        while b"\r\n\r\n" not in raw:
            raw += await stream.receive()
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


async def _error(stream: anyio.abc.SocketStream) -> tuple[int, str, dict[str, str]]:
    status, headers, body = await _answer_head(stream)
    with anyio.fail_after(30):
        while len(body) < int(headers["content-length"]):
            body += await stream.receive()
    return status, json.loads(body)["error"]["code"], headers


async def _import(node: RunningNode, session: str, kv: np.ndarray) -> tuple[int, str | None]:
    stream = await _connect(node, "127.0.0.1", _import_head(node, session, kv, expect=False))
    async with stream:
        await stream.send(kv.tobytes())
        status, headers, body = await _answer_head(stream)
        with anyio.fail_after(30):
            while len(body) < int(headers["content-length"]):
                body += await stream.receive()
    return status, json.loads(body)["error"]["code"] if status >= 400 else None


async def _wait_until(what: str, done: Callable[[], bool]) -> None:
    await wait_until(done, what, timeout=20)


@anyio_test
async def test_unread_exports_count_in_the_inflight_budget_until_they_end(
    checkpoint: str,
) -> None:
    async with _node(checkpoint) as node:
        session, kv = "5e55104e-0000-4000-8000-000000000001", _kv(POSITIONS)
        assert await _import(node, session, kv) == (200, None)
        budget = node.server.budget
        assert budget is not None and node.app.handoff.inflight is budget
        streams = [await _connect(node, "127.0.0.1", _export_head(session)) for _ in range(3)]
        try:
            assert (await _answer_head(streams[0]))[0] == 200
            assert (await _answer_head(streams[1]))[0] == 200
            status, code, headers = await _error(streams[2])
            assert (status, code, headers["retry-after"]) == (503, "kv_transfers_full", "2")
            # The two copies waiting for their readers are held in the budget.
            assert budget.in_use == 2 * kv.nbytes
            assert node.app.info()["handoff"]["transfers"]["open"] == 2
        finally:
            for stream in streams:
                await stream.aclose()
        await _wait_until("the exports' bytes given back", lambda: budget.in_use == 0)
        await _wait_until("their places given back", lambda: node.app.handoff.transfers.open == 0)


@anyio_test
async def test_an_import_head_without_its_body_ends_at_the_import_timeout(
    checkpoint: str,
) -> None:
    async with _node(checkpoint, "--kv-import-timeout", "0.5") as node:
        store = node.app.handoff.store
        assert store is not None
        before = store.kv_free_bytes()
        kv = _kv(64)
        heads = [
            await _connect(
                node,
                "127.0.0.2",
                _import_head(node, f"5e55104e-0000-4000-8000-00000000010{i}", kv, expect=True),
            )
            for i in range(3)
        ]
        try:
            assert (await _answer_head(heads[0]))[0] == 100
            assert (await _answer_head(heads[1]))[0] == 100
            assert (await _error(heads[2]))[:2] == (503, "kv_transfers_full")
            assert store.kv_free_bytes() == before - 2 * kv.nbytes
            for stream in heads[:2]:  # not the server's 60 s body timeout
                assert (await _error(stream))[:2] == (408, "request_timeout")
        finally:
            for stream in heads:
                await stream.aclose()
        await _wait_until("the set-aside bytes given back", lambda: store.kv_free_bytes() == before)
        assert node.app.handoff.transfers.open == 0
        bad = kv.copy()
        bad[1, 0, 0, 2, 5, 9] = np.nan
        assert await _import(node, "5e55104e-0000-4000-8000-000000000200", bad) == (400, "bad_kv")
        assert store.kv_free_bytes() == before and len(node.app.table) == 0

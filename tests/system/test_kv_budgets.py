"""Every byte a KV move makes a node hold is inside a budget (wire-2 §3.11;
issue 37, part 4), over a real node process.

* Exports never read: each holds a copy of the session's KV while its
  answer waits; they are bounded by the per-peer transfer places and the
  in-flight budget (503 ``kv_transfers_full`` / ``memory_full`` past them),
  the node's RSS stays within the budget while they hang, and comes back
  when their clients close or the write timeout ends them.
* Import heads whose body never comes (``Expect: 100-continue``): bounded
  per peer and node-wide before any byte is set aside, and each ends with
  408 at ``--kv-import-timeout``, its bytes given back.
* A KV holding NaN or infinity is refused: 400 ``bad_kv``, nothing created.

Peers are told apart by their address: the clients bind 127.0.0.x.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet_model.testing import small_config, write_checkpoint
from meshnet_proto.lowlevel import kv_checksum
from support.gateway import stop
from support.model_surface import info, spawn_logged
from support.security import host_port, new_session, parse_answer, request, rss_kib, send, wire
from support.waiting import wait_until_sync

KEY = b"0123456789abcdef0123456789abcdef"
# 8 layers x 2 x 8 KV heads x 64 x float32: 32 KiB a position; a 2,048-position
# session's KV is 64 MiB, far above the RSS noise of a node.
LAYOUT = (8, 8, 64)
POSITIONS = 2048
KV_BYTES = LAYOUT[0] * 2 * LAYOUT[1] * POSITIONS * LAYOUT[2] * 4
MiB = 1024 * 1024
SLACK = 40 * MiB  # allocator and thread noise of a node process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kv-budgets-model")
    layers, heads, head_dim = LAYOUT
    config = small_config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    write_checkpoint(root, config, seed=5)
    return root


@contextlib.contextmanager
def _node(logs: Path, *args: str) -> Iterator[tuple[str, int]]:
    proc, url = spawn_logged("meshnet_node", ["--log-level", "warning", *args], logs)
    try:
        yield url, proc.pid
        assert stop(proc) == 0, logs.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kv(positions: int, seed: int = 0) -> np.ndarray:
    layers, heads, head_dim = LAYOUT
    shape = (layers, 2, 1, heads, positions, head_dim)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _import_pairs(url: str, session: str, kv: np.ndarray) -> list[tuple[bytes, bytes]]:
    shape = ",".join(map(str, kv.shape)).encode()
    pairs = wire(session, shape=shape, dtype=b"float32", position=kv.shape[4])
    pairs += [
        (b"X-Meshnet-KV-Checksum", kv_checksum(kv).encode()),
        (b"X-Meshnet-KV-Fingerprint", info(url)["identity"]["fingerprint"].encode()),
        (b"X-Meshnet-Session-Key", KEY),
    ]
    return pairs


def _import(url: str, session: str, kv: np.ndarray):
    pairs = _import_pairs(url, session, kv)
    return send(url, request(pairs, kv.tobytes(), target=b"/forward?kv=1"))


def _open(url: str, peer: str, data: bytes) -> socket.socket:
    """A connection from ``peer`` (a loopback address) that sent ``data`` and reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.bind((peer, 0))
    sock.connect(host_port(url))
    sock.sendall(data)
    return sock


def _head(sock: socket.socket) -> tuple[int, bytes]:
    """The status and head of the first answer on ``sock`` (its body left unread)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        piece = sock.recv(1)
        assert piece, f"closed after {raw!r}"
        raw += piece
    return int(raw.split(b" ", 2)[1]), raw


def _error(sock: socket.socket, head: bytes) -> dict:
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return json.loads(body)["error"]


def _export_request(session: str) -> bytes:
    return (
        f"GET /kv/{session} HTTP/1.1\r\nHost: node\r\nX-Meshnet-Session-Key: {KEY.decode()}\r\n\r\n"
    ).encode()


def _wait(what: str, done: Callable[[], bool], seconds: float = 30.0) -> None:
    wait_until_sync(done, what, timeout=seconds, every=0.1)


def _rss(pid: int) -> int:
    return rss_kib(pid)[0] * 1024


def _open_transfers(url: str) -> int:
    return int(info(url)["handoff"]["transfers"]["open"])


def _export_once(url: str, session: str):
    """``GET /kv/{session}`` read whole, on a connection that then closes."""
    data = _export_request(session).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    return send(url, data, limit=KV_BYTES + 65536)


def _read_export(url: str, session: str) -> bytes:
    answer = _export_once(url, session)
    assert answer.status == 200, answer.raw[:300]
    return answer.body


def test_unread_exports_stay_inside_their_budget_and_the_rss_comes_back(
    model_dir: Path, tmp_path: Path
) -> None:
    budget = KV_BYTES * 5 // 2  # two exports' copies, not three
    flags = ["--model", str(model_dir), "--max-inflight-bytes", str(budget), "--timeout", "6"]
    with _node(tmp_path / "node.log", *flags) as (url, pid):
        session, kv = new_session(), _kv(POSITIONS)
        assert _import(url, session, kv).status == 200
        assert _read_export(url, session) == kv.tobytes()  # and the allocator has seen one
        baseline = _rss(pid)
        # Six exports nobody reads: two from one peer hang (each holding a
        # copy); a third of that peer is past its places, and another peer's
        # are past the in-flight budget.
        socks = [
            _open(url, peer, _export_request(session))
            for peer in ("127.0.0.1",) * 3 + ("127.0.0.2",) * 3
        ]
        try:
            answers = [_head(sock) for sock in socks]
            statuses = [status for status, _ in answers]
            assert statuses == [200, 200, 503, 503, 503, 503], statuses
            codes = [_error(socks[i], answers[i][1])["code"] for i in range(2, 6)]
            assert codes == ["kv_transfers_full"] + ["memory_full"] * 3
            assert all(b"\r\nretry-after: " in head.lower() for _, head in answers[2:])
            hanging = _rss(pid) - baseline
            assert hanging <= budget + SLACK, f"RSS grew {hanging / MiB:.0f} MiB"
            assert _open_transfers(url) == 2
        finally:
            for sock in socks:
                sock.close()
        _wait("the closed exports' copies freed", lambda: _rss(pid) <= baseline + SLACK)
        _wait("their places given back", lambda: _open_transfers(url) == 0)
        # Two more, never read and left open: the write timeout (--timeout) ends them.
        socks = [_open(url, "127.0.0.3", _export_request(session)) for _ in range(2)]
        try:
            assert [_head(sock)[0] for sock in socks] == [200, 200]
            _wait("the unread exports ended", lambda: _open_transfers(url) == 0)
            _wait("their copies freed", lambda: _rss(pid) <= baseline + SLACK)
        finally:
            for sock in socks:
                sock.close()
        assert _read_export(url, session) == kv.tobytes()  # the node still moves it


def test_import_heads_whose_body_never_comes_are_bounded_and_time_out(
    model_dir: Path, tmp_path: Path
) -> None:
    with _node(tmp_path / "node.log", "--model", str(model_dir), "--kv-import-timeout", "1") as (
        url,
        _,
    ):
        before = int(info(url)["stage"]["kv_bytes_in_use"])
        kv = _kv(256)

        def head(peer: str) -> socket.socket:
            pairs = _import_pairs(url, new_session(), kv)
            data = request(
                [*pairs, (b"Expect", b"100-continue")],
                b"",
                target=b"/forward?kv=1",
                length=b"%d" % kv.nbytes,
                close=False,
            )
            return _open(url, peer, data)

        # Per peer 2, node-wide 4: the third head of a peer, and a fifth
        # head from a third peer, are refused before any byte is set aside.
        socks = [head(peer) for peer in ("127.0.0.1",) * 3 + ("127.0.0.2",) * 2 + ("127.0.0.3",)]
        try:
            answers = [_head(sock) for sock in socks]
            assert [status for status, _ in answers] == [100, 100, 503, 100, 100, 503]
            for index in (2, 5):
                assert _error(socks[index], answers[index][1])["code"] == "kv_transfers_full"
            assert int(info(url)["stage"]["kv_bytes_in_use"]) == before + 4 * kv.nbytes
            # No body by --kv-import-timeout: 408, and the bytes come back.
            for index in (0, 1, 3, 4):
                status, late = _head(socks[index])
                assert status == 408 and _error(socks[index], late)["code"] == "request_timeout"
        finally:
            for sock in socks:
                sock.close()
        _wait(
            "the set-aside bytes given back",
            lambda: int(info(url)["stage"]["kv_bytes_in_use"]) == before,
        )
        assert _open_transfers(url) == 0
        assert _import(url, new_session(), kv).status == 200  # a move that sends its body


def test_an_import_holding_nan_or_infinity_is_refused(model_dir: Path, tmp_path: Path) -> None:
    with _node(tmp_path / "node.log", "--model", str(model_dir)) as (url, _):
        before = int(info(url)["stage"]["kv_bytes_in_use"])
        for bad in (np.nan, np.inf, -np.inf):
            kv = _kv(16)
            kv[3, 1, 0, 2, 7, 5] = bad
            session = new_session()
            answer = _import(url, session, kv)
            assert (answer.status, answer.code) == (400, "bad_kv"), answer.raw[:300]
            assert _export_once(url, session).code == "not_found"  # nothing was created
            assert int(info(url)["stage"]["kv_bytes_in_use"]) == before
        session, kv = new_session(), _kv(16)
        assert _import(url, session, kv).status == 200  # the same KV, finite
        step = wire(session, shape=b"1,1", dtype=b"int32", position=16)
        step.append((b"X-Meshnet-Session-Key", KEY))
        answer = send(url, request(step, np.asarray([[7]], "<i4").tobytes()))
        assert answer.status == 200
        assert np.isfinite(np.frombuffer(answer.body, dtype="<f4")).all()
        assert parse_answer(answer.raw).status == 200

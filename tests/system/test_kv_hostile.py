"""The KV hand-off's two routes against hostile peers, over real processes
(wire-2 §3.11; issue 23): a model node, a stub node and a gateway.

Every refusal is the spec's 4xx/503 with its JSON body, creates nothing,
leaks no KV bytes (what an import's head set aside comes back), and leaves
the node up and the live session untouched: its next chunk still runs.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet_proto.lowlevel import kv_checksum
from support.gateway import stop
from support.model_surface import info, spawn_logged, write_model
from support.security import get, host_port, new_session, request, send, wire
from support.waiting import holds_within

KEY = b"0123456789abcdef0123456789abcdef"
PROMPT = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("kv-hostile-model"))


@contextlib.contextmanager
def _node(logs: Path, *args: str) -> Iterator[str]:
    proc, url = spawn_logged("meshnet_node", ["--log-level", "info", *args], logs)
    try:
        yield url
        assert stop(proc) == 0, logs.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ids(session: str, position: int, ids: list[int], key: bytes | None = KEY) -> bytes:
    pairs = wire(session, shape=b"1,%d" % len(ids), dtype=b"int32", position=position)
    if key is not None:
        pairs.append((b"X-Meshnet-Session-Key", key))
    return request(pairs, np.asarray(ids, dtype="<i4").tobytes())


def _export(url: str, session: str, key: bytes | None = KEY):
    lines = [f"GET /kv/{session} HTTP/1.1", "Host: localhost", "Connection: close"]
    if key is not None:
        lines.append(f"X-Meshnet-Session-Key: {key.decode()}")
    return send(url, ("\r\n".join(lines) + "\r\n\r\n").encode())


def _import(url: str, headers: dict[bytes, bytes], body: bytes, **changes: bytes):
    """POST /forward?kv=1 of an export's headers (``changes`` by lowercase name) and body."""
    names = [b"content-type", b"x-meshnet-wire", b"x-meshnet-shape", b"x-meshnet-dtype",
             b"x-meshnet-session", b"x-meshnet-chunk-index", b"x-meshnet-chunk-total",
             b"x-meshnet-position", b"x-meshnet-encoding", b"x-meshnet-kv-checksum",
             b"x-meshnet-kv-fingerprint"]  # fmt: skip
    values = {n: headers[n] for n in names if n in headers}
    values[b"x-meshnet-session-key"] = KEY
    for name, value in changes.items():
        values[name.replace("_", "-").encode()] = value
    pairs = [(n, v) for n, v in values.items() if v]
    return send(url, request(pairs, body, target=b"/forward?kv=1"))


def _kv_in_use(url: str) -> int:
    return int(info(url)["stage"]["kv_live_bytes"])


def test_the_export_and_import_refuse_what_is_not_theirs(model_dir: Path, tmp_path: Path) -> None:
    model = ["--model", str(model_dir)]
    with _node(tmp_path / "a.log", *model) as a, _node(tmp_path / "b.log", *model) as b:
        session = new_session()
        ids = list(range(1, PROMPT + 1))
        assert send(a, _ids(session, 0, ids)).status == 200
        # -- export: unknown, unkeyed, wrongly keyed, wrong method
        assert _export(a, new_session()).code == "not_found"
        assert _export(a, session, key=None).code == "session_forbidden"
        assert _export(a, session, key=b"f" * 32).code == "session_forbidden"
        assert send(a, request([], b"", target=f"/kv/{session}".encode())).status == 405
        good = _export(a, session)
        assert good.status == 200
        h = good.headers
        assert h[b"x-meshnet-position"] == b"%d" % PROMPT
        assert len(h[b"x-meshnet-shape"].split(b",")) == 6
        assert h[b"x-meshnet-kv-fingerprint"].decode() == info(a)["identity"]["fingerprint"]
        assert h[b"x-meshnet-kv-checksum"].decode() == kv_checksum(
            np.frombuffer(good.body, dtype="<f4")
        )
        before = _kv_in_use(b)
        assert before == 0 == int(info(b)["stage"]["kv_bytes_in_use"])
        other = new_session()
        # -- import: each hostile variant refused, nothing created, nothing held
        flipped = bytearray(good.body)
        flipped[100] ^= 0x40
        shape = h[b"x-meshnet-shape"].split(b",")
        cases = [
            ({}, bytes(flipped), 400, "bad_kv", "x-meshnet-kv-checksum"),
            ({"x_meshnet_kv_fingerprint": b"a" * 32}, good.body, 409, "stage_mismatch",
             "x-meshnet-kv-fingerprint"),
            ({"x_meshnet_kv_checksum": b""}, good.body, 400, "bad_kv", "x-meshnet-kv-checksum"),
            ({"x_meshnet_kv_checksum": b"XYZ"}, good.body, 400, "bad_kv", "x-meshnet-kv-checksum"),
            ({"x_meshnet_position": b"3"}, good.body, 400, "bad_kv", "x-meshnet-position"),
            ({"x_meshnet_chunk_total": b"2"}, good.body, 400, "bad_kv", "x-meshnet-chunk-index"),
            ({"x_meshnet_shape": b",".join([b"1", *shape[1:]])}, good.body[: len(good.body)
              // int(shape[0])], 400, "bad_kv", "x-meshnet-shape"),
            ({"x_meshnet_dtype": b"float16"}, good.body[: len(good.body) // 2], 400, "bad_kv",
             "x-meshnet-dtype"),
            ({"x_meshnet_shape": b",".join([*shape[:4], b"600", shape[5]]),
              "x_meshnet_position": b"600"}, bytes(len(good.body) // PROMPT * 600), 400,
             "bad_kv", "x-meshnet-position"),
        ]  # fmt: skip
        for changes, body, status, code, header in cases:
            answer = _import(b, h, body, x_meshnet_session=other.encode(), **changes)
            assert (answer.status, answer.code, answer.error["header"]) == (status, code, header)
            assert _export(b, other).code == "not_found"  # nothing was created
            assert _kv_in_use(b) == before
        # KV headers on a plain chunk; an import of a session the node holds
        plain = wire(new_session(), shape=b"1,2", dtype=b"int32", position=0)
        plain.append((b"X-Meshnet-KV-Checksum", h[b"x-meshnet-kv-checksum"]))
        assert send(a, request(plain, b"\x01\x00\x00\x00\x02\x00\x00\x00")).code == "bad_kv"
        assert _import(a, h, good.body).code == "session_exists"
        # A head whose body never comes: the bytes it set aside come back.
        host, port = host_port(b)
        pairs = [(n, v) for n, v in h.items() if n.startswith((b"x-meshnet", b"content-type"))
                 and n != b"content-length"]  # fmt: skip
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(request([*pairs, (b"X-Meshnet-Session-Key", KEY)], b"",
                                 target=b"/forward?kv=1", length=b"%d" % len(good.body),
                                 close=False))  # fmt: skip
            sock.sendall(good.body[:1000])  # and then goes away
        assert holds_within(lambda: int(info(b)["stage"]["kv_bytes_in_use"]) == before, timeout=20)
        # -- the move itself, then the session goes on at b, bit for bit as at a
        moved = _import(b, h, good.body)
        assert moved.status == 200 and json.loads(moved.body)["position"] == PROMPT
        at_a = send(a, _ids(session, PROMPT, [7]))
        at_b = send(b, _ids(session, PROMPT, [7]))
        assert at_a.status == at_b.status == 200 and at_a.body == at_b.body
        assert _kv_in_use(b) > before  # the imported session, nothing else
        assert get(a, "/health").status == get(b, "/health").status == 200


def test_a_stub_node_and_a_gateway_hold_no_kv(tmp_path: Path) -> None:
    with _node(tmp_path / "stub.log", "--backend", "echo") as stub:
        session = new_session()
        assert send(stub, request(wire(session, position=0))).status == 200
        assert _export(stub, session, key=None).code == "kv_unsupported"
        kv = np.zeros((1, 2, 1, 1, 4, 2), np.float32)
        pairs = wire(new_session(), shape=b"1,2,1,1,4,2", position=4)
        pairs += [(b"X-Meshnet-KV-Checksum", kv_checksum(kv).encode()),
                  (b"X-Meshnet-KV-Fingerprint", b"0" * 32)]  # fmt: skip
        answer = send(stub, request(pairs, kv.tobytes(), target=b"/forward?kv=1"))
        assert answer.code == "kv_unsupported"
        gateway, url = spawn_logged("meshnet_gateway", ["--entry", stub], tmp_path / "gw.log")
        try:
            assert _export(url, session, key=None).code == "not_found"
            assert send(url, request(pairs, kv.tobytes(), target=b"/forward?kv=1")).code == (
                "bad_kv"
            )
        finally:
            assert stop(gateway) == 0
        assert get(stub, "/health").status == 200

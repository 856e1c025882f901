"""meshnet-node as a user starts it: a subprocess, its ready line, SIGTERM."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from support.waiting import wait_until_sync
from support.wire import raw_forward

pytestmark = pytest.mark.slow


def start(*args: str, next_url: str = "none") -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_node", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)  # ends a hang; not a timing claim
    assert ready, "no ready line within 120 s"
    line = proc.stdout.readline()
    assert line.startswith("meshnet-node listening on http://127.0.0.1:"), line
    assert f"(wire 2, stage echo, next: {next_url}" in line
    url = line.split()[3]
    return proc, url


def http(url: str, request: bytes, sock: socket.socket | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    own = sock is None
    sock = sock or socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(request)
        return read(sock)
    finally:
        if own:
            sock.close()


def read(sock: socket.socket) -> tuple[int, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, "connection closed before a response"
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(backend: str) -> None:
    proc, url = start("--delay-ms", "1500", "--async-backend", backend)
    try:
        assert http(url, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200
        host, port = url.removeprefix("http://").rsplit(":", 1)
        busy = socket.create_connection((host, int(port)), timeout=30)
        busy.sendall(raw_forward(str(uuid.uuid4())))
        processed = b'meshnet_chunks_total{outcome="processed"} 1.0'
        wait_until_sync(
            lambda: processed in http(url, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")[1],
            "the stage running",
        )
        proc.send_signal(signal.SIGTERM)
        status, body = read(busy)  # the request in flight completes
        assert (status, body) == (200, bytes(range(16)))
        busy.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()


def test_bad_flag_exits_2_naming_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--next", "localhost:80"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--next" in result.stderr and "http://host:port" in result.stderr


def test_info_over_a_subprocess_shows_the_downstream() -> None:
    downstream = "http://127.0.0.1:9"
    proc, url = start("--next", downstream, next_url=downstream)
    try:
        status, body = http(url, b"GET /info HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (status, json.loads(body)["downstream"]) == (200, downstream)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()

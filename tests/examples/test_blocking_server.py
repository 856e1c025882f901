"""examples/blocking_server.py over a real loopback socket.

The one test file with sockets: it starts the example as a subprocess,
sends activations through a ClientConnection on a raw socket, and checks
the echo bit for bit, keep-alive, and a wire-2 §4 error for a bad request.
That it is a whole node is test_blocking_server_conformance.py's.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet_proto import (
    NEED_DATA,
    ActivationResponse,
    ClientConnection,
    ErrorResponse,
    Response,
    WireHeaders,
    encode_tensor,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blocking_server.py"
SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120.0)  # ends a hang only
        assert ready, "the example server did not start"
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def exchange(sock: socket.socket, client: ClientConnection, pieces: list) -> object:
    for piece in pieces:
        sock.sendall(piece)
    while (event := client.next_event()) is NEED_DATA:
        client.receive_data(sock.recv(65536))
    return event


def test_activation_echo_is_bit_exact_with_keep_alive(server_port: int) -> None:
    rng = np.random.default_rng(7)
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as sock:
        client = ClientConnection(host=f"127.0.0.1:{server_port}")
        for index, encoding in enumerate(["identity", "zstd", "identity"]):
            array = rng.standard_normal((1, 33, 17)).astype(np.float32)
            # Bit patterns a lossy path would not keep: -0.0 and a NaN payload.
            array[0, 0, 0] = -0.0
            array.view(np.uint32)[0, 0, 1] = 0x7FC01234
            # A node needs the position of every chunk but a session's first (§3.1).
            wire = WireHeaders.for_array(
                array,
                session=SESSION,
                chunk_index=index,
                chunk_total=3,
                encoding=encoding,
                position=33 * index,
            )
            body = encode_tensor(array, encoding=encoding)
            response = exchange(sock, client, client.send_activation(wire, body))
            assert isinstance(response, ActivationResponse)
            assert response.headers == wire  # the answer says the chunk's position
            assert response.tensor.tobytes() == array.tobytes()
            assert client.reusable
        health = exchange(sock, client, client.send_request("GET", "/health"))
        assert health == Response(status=200, headers=health.headers, body=b"ok")


def test_bad_request_gets_a_spec_error(server_port: int) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as sock:
        client = ClientConnection()
        body = json.dumps({"shape": [1, 2], "data": [1.0, 2.0]}).encode()
        pieces = client.send_request(
            "POST", "/forward", [(b"Content-Type", b"application/json")], body
        )
        response = exchange(sock, client, pieces)
        assert isinstance(response, ErrorResponse)
        assert response.status == 415
        assert response.error["code"] == "wire1_gone"
        assert json.loads(response.raw)["error"]["status"] == 415
        assert not client.reusable  # the server closed after the error
        assert sock.recv(1) == b""

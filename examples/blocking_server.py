"""A minimal blocking wire-2 server: stdlib sockets around ServerConnection.

It echoes every activation back (the stage is the identity) and answers
``GET /health``; one connection at a time, keep-alive supported. It exists
to show how little a driver does — read, feed, act, write — see
docs/embedding.md. Run::

    python examples/blocking_server.py --port 8000
    python examples/blocking_server.py --port 0     # prints the port it got
"""

from __future__ import annotations

import argparse
import contextlib
import socket

from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    ProtocolErrorReceived,
    ServerConnection,
    encode_tensor,
)


def write(sock: socket.socket, pieces: list) -> None:
    for piece in pieces:  # the tensor body is one piece, written as is
        sock.sendall(piece)


def drain(sock: socket.socket, limit: int = 64 * 1024, seconds: float = 1.0) -> None:
    # An answer sent before the request was read: read what the client still
    # sends, briefly, so closing does not reset the connection under it.
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(seconds)
    with contextlib.suppress(OSError):
        while limit > 0 and (data := sock.recv(min(limit, 65536))):
            limit -= len(data)


def serve(sock: socket.socket, token: str | None) -> None:
    conn = ServerConnection(token=token)
    sock.settimeout(10.0)  # the head/body timeout of this toy
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, ActivationHead):
            if event.expects_continue:  # the place for header-only checks
                sock.sendall(conn.send_continue())
        elif isinstance(event, ActivationReceived):
            # The "stage" is the identity; the answer mirrors the encoding.
            body = encode_tensor(event.tensor, encoding=event.headers.encoding)
            write(sock, conn.send_activation(event.headers, body))
        elif isinstance(event, EndpointRequest):
            status = 200 if event.path == "/health" else 204
            write(sock, conn.send_response(status, body=b"ok" if status == 200 else b""))
        elif isinstance(event, ProtocolErrorReceived):
            write(sock, conn.send_error(event.error))
        else:  # ConnectionClosed: after an error, a close, or end of stream
            assert isinstance(event, ConnectionClosed)
            break
    if conn.needs_drain:
        drain(sock)


def main() -> None:
    parser = argparse.ArgumentParser(description="blocking wire-2 echo server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    with socket.create_server((args.host, args.port)) as listener:
        print(f"listening on {args.host}:{listener.getsockname()[1]}", flush=True)
        while True:
            sock, _ = listener.accept()
            # The client went away or timed out: on to the next one.
            with sock, contextlib.suppress(OSError):
                serve(sock, args.token)


if __name__ == "__main__":
    main()

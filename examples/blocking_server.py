"""A conformant wire-2 node in stdlib sockets and threads around the core.

The stage is the identity (an echo). Everything else a node owes wire 2 is
the core's: ``ServerConnection`` parses and answers each connection,
``NodeControl`` holds the ``SessionTable`` (sessions, positions, order,
retransmissions, owner keys) and answers the control endpoints (``/info``,
``/metrics``, ``DELETE /sessions/{id}``, ``/kv``, ``/drawn``); a sampled
chunk's token is drawn by meshnet's reference draw, as a last stage must
(wire-2 §3.13). What is left here is the driver's part — read, feed, act,
write, and wait — see docs/embedding.md. ``meshnet conformance`` passes
against it (tests/examples/test_blocking_server_conformance.py).

One thread per connection: a chunk that arrives before its predecessor
waits (wire-2 §3.3) while another connection brings the predecessor. The
table is shared, so every call to it holds one lock; the echo runs under
it too, which serialises the stage (a real node runs it outside). Run::

    python examples/blocking_server.py --port 8000
    python examples/blocking_server.py --port 0     # prints the port it got
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time

import numpy as np

from meshnet_node.draw import draw_answer, verify_answer
from meshnet_proto import (
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    MeshnetError,
    Process,
    ProtocolErrorReceived,
    Replay,
    ServerConnection,
    Wait,
    encode_tensor,
    tensor_fingerprint,
)
from meshnet_proto.lowlevel import (
    NodeControl,
    Ticket,
    answer_headers,
    stub_identity,
    wire_dtype_name,
)


class EchoNode:
    """The node's state, shared by the connections' threads."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.control = NodeControl(stub_identity("echo"))
        self.table = self.control.table
        self.lock = threading.Condition()  # wakes waiting chunks (wire-2 §3.3)

    def activation(self, event: ActivationReceived, started: float, peer: str) -> tuple:
        """The answer ``(headers, body)`` to a chunk; raises the error to answer."""
        headers, now = event.headers, time.monotonic
        ms = headers.deadline_ms
        deadline = None if ms is None else started + ms / 1000
        fingerprint, waiter = tensor_fingerprint(event.tensor), None
        client = headers.client or peer  # whose session quota it counts against
        with self.lock:
            while True:  # the table, not this loop, says when a wait is over
                decision = self.table.offer(
                    headers,
                    fingerprint,
                    now(),
                    waiter=waiter,
                    deadline=deadline,
                    replay=event.replay,
                    client=client,
                )
                if not isinstance(decision, Wait):
                    break
                waiter = decision.waiter
                self.lock.wait(max(0.0, decision.until - now()))
            if isinstance(decision, Replay):  # a retransmission: the kept answer
                return decision.response  # type: ignore[no-any-return]
            # The stage runs under the lock, so no chunk is ever in flight
            # when another arrives: no Join, and a last stage has no
            # forward to fail, so no Reforward.
            assert isinstance(decision, Process)
            ticket = decision.ticket
            try:
                output = echo_stage(event, ticket)
            except MeshnetError:
                self.table.stage_failed(ticket, now())
                raise
            self.table.stage_done(ticket, output, now())
            self.lock.notify_all()  # the session's next chunk may run now
            dtype = wire_dtype_name(output.dtype)
            answer = answer_headers(headers, output.shape, dtype, headers.encoding, ticket.position)
            body = encode_tensor(output, encoding=headers.encoding)
            drawn = headers.sample is not None
            self.control.answered(ticket, answer, body, now(), drawn=drawn)
            return answer, body

    def endpoint(self, event: EndpointRequest) -> tuple:
        with self.lock:
            answer = self.control.endpoint(event)
            self.lock.notify_all()  # a DELETE: the session's waiters find it gone
            return answer

    def serve(self, sock: socket.socket, peer: str) -> None:
        conn = ServerConnection(limits=self.control.limits, token=self.token)
        sock.settimeout(10.0)  # the head/body timeout of this example
        started = time.monotonic()
        while True:
            event = conn.next_event()
            try:
                if event is NEED_DATA:
                    conn.receive_data(sock.recv(65536))
                elif isinstance(event, ActivationHead):
                    started = time.monotonic()  # the request's deadline runs from here
                    with self.lock:  # header-only checks: reject before the body
                        client = event.headers.client or peer
                        self.control.check_head(
                            event.headers, started, replay=event.replay, client=client
                        )
                    if event.expects_continue:
                        sock.sendall(conn.send_continue())
                elif isinstance(event, ActivationReceived):
                    write(sock, conn.send_activation(*self.activation(event, started, peer)))
                elif isinstance(event, EndpointRequest):
                    write(sock, conn.send_response(*self.endpoint(event)))
                elif isinstance(event, ProtocolErrorReceived):
                    write(sock, conn.send_error(event.error))
                else:  # ConnectionClosed: after an error, a close, or end of stream
                    assert isinstance(event, ConnectionClosed)
                    break
            except MeshnetError as err:  # a refused chunk or request: a §4 answer
                write(sock, conn.send_error(err))
        if conn.needs_drain:
            drain(sock)


def echo_stage(event: ActivationReceived, ticket: Ticket) -> np.ndarray:
    """The stage: the identity. A sampled chunk asks the last stage for the
    token drawn from its output instead (wire-2 §3.13), or a verify
    window's tokens (§3.16): meshnet's reference draw, at the chunk's place."""
    output, sample, draft = event.tensor, event.headers.sample, event.headers.draft
    if sample is None:
        return output
    if draft is None:
        return draw_answer(output, sample, ticket.position + ticket.tokens)
    return verify_answer(output, sample, draft, ticket.position)


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


def handle(node: EchoNode, sock: socket.socket, peer: str) -> None:
    with sock, contextlib.suppress(OSError):  # the client went away or timed out
        node.serve(sock, peer)


def main() -> None:
    parser = argparse.ArgumentParser(description="blocking wire-2 echo node")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    node = EchoNode(args.token)
    with socket.create_server((args.host, args.port)) as listener:
        print(f"listening on {args.host}:{listener.getsockname()[1]}", flush=True)
        while True:
            sock, (address, *_) = listener.accept()
            threading.Thread(target=handle, args=(node, sock, address), daemon=True).start()


if __name__ == "__main__":
    main()

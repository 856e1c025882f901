"""Session ownership over real processes (wire-2 §3.9): a stranger who knows
a session's id cannot replay, continue or delete it, nor make its owner lose
anything; a chunk that leaves its position to the node is only a new
session's first; one client cannot fill a node's or a gateway's table.

A tiny random model stage (its logits depend on the whole history in its KV
cache) serves the victim and an untouched control session fed the same
tokens: after every refused request the victim's next logits must equal the
control's, bit for bit. Requests are raw wire-2 bytes (support.security), so
nothing tidies what is sent or answered.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from meshnet_model.testing.random_gguf import TINY, TINY_WEIGHT_STD, write_random_gguf
from support.gateway import spawn, stop
from support.security import (
    BODY,
    Answer,
    Pairs,
    host_port,
    new_session,
    parse_answer,
    request,
    send,
    wire,
)


@dataclass
class Procs:
    model: str  # a node serving the whole tiny model: tokens in, logits out
    quota: str  # an echo node, --max-sessions 8 (4 a client)
    gateway: str  # a gateway before an echo node
    small_gateway: str  # another, --max-sessions 4 (2 a client)


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    path = tmp_path_factory.mktemp("own") / "tiny.gguf"
    write_random_gguf(path, TINY, "Q8_0", weight_std=TINY_WEIGHT_STD)
    started: list[subprocess.Popen[str]] = []
    try:
        model, model_url = spawn("meshnet_node", "--model", str(path), "--layers", "0:2",
                                 timeout=120)  # fmt: skip
        started.append(model)
        quota, quota_url = spawn("meshnet_node", "--max-sessions", "8")
        started.append(quota)
        entry, entry_url = spawn("meshnet_node", "--backend", "count")
        started.append(entry)
        gateway, gateway_url = spawn("meshnet_gateway", "--entry", entry_url)
        started.append(gateway)
        small, small_url = spawn("meshnet_gateway", "--max-sessions", "4", "--entry", entry_url)
        started.append(small)
        yield Procs(model_url, quota_url, gateway_url, small_url)
        for proc in reversed(started):
            assert stop(proc) == 0
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def key_pair(key: str | None) -> Pairs:
    return [] if key is None else [(b"X-Meshnet-Session-Key", key.encode())]


def tokens_chunk(
    session: str,
    ids: list[int],
    position: int | None,
    key: str | None,
    *,
    replay: bool = False,
) -> bytes:
    body = np.asarray([ids], dtype="<i4").tobytes()
    pairs = wire(session, shape=b"1,%d" % len(ids), dtype=b"int32", position=position)
    target = b"/forward?replay=1" if replay else b"/forward"
    return request([*pairs, *key_pair(key)], body, target=target)


def delete(session: str, key: str | None) -> bytes:
    head = [f"DELETE /sessions/{session} HTTP/1.1".encode(), b"Host: [::1]", b"Connection: close"]
    head += [name + b": " + value for name, value in key_pair(key)]
    return b"\r\n".join(head) + b"\r\n\r\n"


# Every key a test made: none may show in any answer (wire-2 §3.9).
KEYS: list[str] = []


def new_key() -> str:
    KEYS.append(secrets.token_hex(16))
    return KEYS[-1]


def refused(answer: Answer, status: int, code: str, header: str) -> None:
    assert (answer.status, answer.code) == (status, code), answer.raw[:400]
    assert answer.error["header"] == header
    assert b"x-meshnet-session-key" not in answer.raw.lower().split(b"\r\n\r\n")[0]
    assert not any(key.encode() in answer.raw for key in KEYS)


def logits(answer: Answer) -> bytes:
    assert answer.status == 200, answer.raw[:400]
    return answer.body


class Twins:
    """A victim and a control session, same tokens, each with its own key."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.victim, self.victim_key = new_session(), new_key()
        self.control, self.control_key = new_session(), new_key()
        self.position = 0

    def step(self, ids: list[int]) -> bytes:
        """Both take ``ids``; the victim's logits must be the control's (returned)."""
        mine = send(self.url, tokens_chunk(self.victim, ids, self.position, self.victim_key))
        theirs = send(self.url, tokens_chunk(self.control, ids, self.position, self.control_key))
        assert mine.headers[b"x-meshnet-position"] == b"%d" % self.position
        assert logits(mine) == logits(theirs)
        self.position += len(ids)
        return mine.body


STRANGER_IDS = [7, 7, 7, 7, 7, 7, 7, 7]


def test_a_stranger_cannot_rewrite_continue_or_end_a_session(procs: Procs) -> None:
    url = procs.model
    twins = Twins(url)
    twins.step(list(range(1, 9)))
    victim, stranger_key = twins.victim, new_key()
    # A replay of the session's start with other ids: without a key, with a
    # wrong one (403), even with the right one (409: a replay never rewrites a
    # live session, wire-2 §3.9).
    for key, status, code, header in (
        (None, 403, "session_forbidden", "x-meshnet-session-key"),
        (stranger_key, 403, "session_forbidden", "x-meshnet-session-key"),
        (twins.victim_key, 409, "session_exists", "x-meshnet-session"),
    ):
        answer = send(url, tokens_chunk(victim, STRANGER_IDS, 0, key, replay=True))
        refused(answer, status, code, header)
    after = twins.step([9, 10])
    # (The logits do depend on the history: after other ids, [9, 10] differ.)
    other, other_key = new_session(), new_key()
    assert send(url, tokens_chunk(other, STRANGER_IDS, 0, other_key)).status == 200
    elsewhere = logits(send(url, tokens_chunk(other, [9, 10], 8, other_key)))
    assert len(elsewhere) == len(after) and elsewhere != after
    assert send(url, delete(other, other_key)).status == 204
    # Continuing it at its position, without a key, with another, with the
    # key one digit off: 403. The key in upper case is no key at all (400).
    last = "1" if twins.victim_key[-1] == "0" else "0"
    for key in (None, stranger_key, twins.victim_key[:-1] + last):
        answer = send(url, tokens_chunk(victim, STRANGER_IDS[:2], twins.position, key))
        refused(answer, 403, "session_forbidden", "x-meshnet-session-key")
    upper = twins.victim_key.upper().replace("0", "A")  # (at least one letter)
    answer = send(url, tokens_chunk(victim, STRANGER_IDS[:2], twins.position, upper))
    refused(answer, 400, "bad_session_key", "x-meshnet-session-key")
    assert twins.victim_key.encode() not in answer.raw and upper.encode() not in answer.raw
    twins.step([11])
    # The victim's own append without X-Meshnet-Position: 409, nothing consumed.
    answer = send(url, tokens_chunk(victim, [12], None, twins.victim_key))
    refused(answer, 409, "position_required", "x-meshnet-position")
    twins.step([12, 13, 14])
    # A stranger's DELETE, without the key or with another: 403, the session lives.
    for key in (None, stranger_key):
        refused(send(url, delete(victim, key)), 403, "session_forbidden", "x-meshnet-session-key")
    twins.step([15])
    # The owner ends it; then it is gone (a replay of its start may rebuild it now).
    assert send(url, delete(victim, twins.victim_key)).status == 204
    assert send(url, delete(twins.control, twins.control_key)).status == 204
    assert send(url, delete(victim, twins.victim_key)).status == 404
    again = send(url, tokens_chunk(victim, STRANGER_IDS, 0, stranger_key, replay=True))
    assert again.status == 200
    assert send(url, delete(victim, stranger_key)).status == 204


def send_from(source: str, url: str, data: bytes) -> Answer:
    """``send``, from the loopback address ``source`` (all of 127/8 is loopback)."""
    out = bytearray()
    with socket.create_connection(host_port(url), timeout=20, source_address=(source, 0)) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while piece := sock.recv(1 << 16):
            out += piece
    return parse_answer(bytes(out))


def opening(session: str, key: str) -> bytes:
    """Chunk 0 of a two-chunk run: the session stays open."""
    return request([*wire(session, index=0, total=2, position=0), *key_pair(key)])


def test_one_client_cannot_fill_the_table(procs: Procs) -> None:
    url = procs.quota  # --max-sessions 8: 4 a client (the default, half)
    mine = {new_session(): new_key() for _ in range(4)}
    for session, key in mine.items():
        assert send_from("127.0.0.1", url, opening(session, key)).status == 200
    answer = send_from("127.0.0.1", url, opening(new_session(), new_key()))
    assert (answer.status, answer.code) == (429, "client_sessions_full"), answer.raw[:300]
    assert answer.headers[b"retry-after"].isdigit()
    # Another client still gets sessions, up to its own quota.
    theirs = {new_session(): new_key() for _ in range(4)}
    for session, key in theirs.items():
        assert send_from("127.0.0.2", url, opening(session, key)).status == 200, session
    # Nothing was lost: every session finishes its run at its position.
    for source, sessions in (("127.0.0.1", mine), ("127.0.0.2", theirs)):
        for session, key in sessions.items():
            pairs = [*wire(session, index=1, total=2, position=4), *key_pair(key)]
            answer = send_from(source, url, request(pairs))
            assert answer.status == 200 and answer.body == BODY
            assert answer.headers[b"x-meshnet-position"] == b"4"
            assert send_from(source, url, delete(session, key)).status == 204
    # Room again for the first client.
    session, key = new_session(), new_key()
    assert send_from("127.0.0.1", url, opening(session, key)).status == 200
    assert send_from("127.0.0.1", url, delete(session, key)).status == 204


def test_a_gateway_session_is_its_owners(procs: Procs) -> None:
    url = procs.gateway
    session = new_session()
    first = send(url, request([*wire(None, index=None, total=None),
                               (b"X-Meshnet-Session", session.encode())]))  # fmt: skip
    assert first.status == 200 and first.body == BODY
    key = first.headers[b"x-meshnet-session-key"].decode()  # minted, told once
    KEYS.append(key)
    assert len(key) == 32

    def chunk(key: str | None, seed: float) -> tuple[bytes, bytes]:
        body = (np.frombuffer(BODY, dtype=np.float32) + seed).tobytes()
        pairs = [*wire(None, index=None, total=None), (b"X-Meshnet-Session", session.encode())]
        return request([*pairs, *key_pair(key)], body), body

    for stranger in (None, new_key()):
        data, _ = chunk(stranger, 1.0)
        refused(send(url, data), 403, "session_forbidden", "x-meshnet-session-key")
        refused(send(url, delete(session, stranger)), 403, "session_forbidden",
                "x-meshnet-session-key")  # fmt: skip
    # The owner goes on where it was (4 tokens in), the strangers' tensors never ran.
    data, body = chunk(key, 2.0)
    answer = send(url, data)
    assert answer.status == 200 and answer.body == body
    assert answer.headers[b"x-meshnet-position"] == b"4"
    assert b"x-meshnet-session-key" not in answer.headers
    assert send(url, delete(session, key)).status == 204


def test_one_client_cannot_fill_the_gateways_table(procs: Procs) -> None:
    url = procs.small_gateway  # --max-sessions 4: 2 a client

    def start(source: str) -> Answer:
        return send_from(source, url, request(wire(None, index=None, total=None)))

    def go_on(source: str, session: bytes, key: bytes) -> Answer:
        pairs = [*wire(None, index=None, total=None), (b"X-Meshnet-Session", session),
                 (b"X-Meshnet-Session-Key", key)]  # fmt: skip
        return send_from(source, url, request(pairs))

    held = []
    for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"):
        answer = start(source)
        assert answer.status == 200, answer.raw[:300]
        held.append((source, answer.headers[b"x-meshnet-session"],
                     answer.headers[b"x-meshnet-session-key"]))  # fmt: skip
        if source == "127.0.0.1" and len(held) == 2:
            # The first client's third: 429, while the second has not started yet.
            over = start(source)
            assert (over.status, over.code) == (429, "client_sessions_full"), over.raw[:300]
            assert over.headers[b"retry-after"].isdigit()
    for source, session, key in held:
        answer = go_on(source, session, key)  # each goes on where it was
        assert answer.status == 200 and answer.headers[b"x-meshnet-position"] == b"4"
        delete_key = key.decode()
        assert send_from(source, url, delete(session.decode(), delete_key)).status == 204

"""Issue 5, access control, over real processes: bearer tokens (wire-2 §7) on
every endpoint but /health, presented down the chain; a TLS chain built on a
throwaway CA; and a client or node with the wrong CA refused.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import json
import signal
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import trustme

import meshnet_proto._credentials as server_module
from meshnet_cli.__main__ import main as meshnet_main
from meshnet_proto import NEED_DATA, ProtocolErrorReceived, ServerConnection
from support.gateway import spawn
from support.security import (
    connect,
    exchange,
    get,
    new_session,
    request,
    send,
    valid_chunk_round_trip,
    wire,
)

TOKEN = "s3cret-Token-9f8e7d6c5b4a"


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
        for proc in procs:  # all at once: each takes a moment to shut down
            proc.send_signal(signal.SIGTERM)
        for proc in procs:  # (a second SIGTERM would cut the graceful shutdown)
            assert proc.wait(20) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def spawn_together(
    procs: list[subprocess.Popen[str]], *specs: tuple[str, list[str], dict[str, str] | None]
) -> list[str]:
    """Start processes that do not depend on each other in parallel; their URLs."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(spawn, module, *args, env=env) for module, args, env in specs]
        started = [future.result() for future in futures]
    procs.extend(proc for proc, _ in started)
    return [url for _, url in started]


def requests_for(token_header: bytes | None) -> dict[str, bytes]:
    """One request per endpoint, with ``token_header`` as its Authorization."""
    auth = [] if token_header is None else [(b"Authorization", token_header)]
    session = new_session()

    def plain(method: str, target: str) -> bytes:
        head = [f"{method} {target} HTTP/1.1".encode(), b"Host: localhost", b"Connection: close"]
        head += [name + b": " + value for name, value in auth]
        return b"\r\n".join(head) + b"\r\n\r\n"

    return {
        "forward": request([*wire(session), *auth]),
        "info": plain("GET", "/info"),
        "metrics": plain("GET", "/metrics"),
        "delete": plain("DELETE", f"/sessions/{session}"),
        "unknown_path": plain("GET", "/nowhere"),
        "health_deep": plain("GET", "/health?deep=1"),
        "health": plain("GET", "/health"),
    }


BAD_CREDENTIALS: dict[str, bytes | None] = {
    "none": None,
    "empty": b"",
    "bearer_only": b"Bearer",
    "wrong": b"Bearer wrong-token",
    "prefix": b"Bearer " + TOKEN[:-1].encode(),
    "longer": b"Bearer " + TOKEN.encode() + b"x",
    "basic_scheme": b"Basic " + TOKEN.encode(),
    "no_scheme": TOKEN.encode(),
    "other_case": b"Bearer " + TOKEN.upper().encode(),
}


def assert_no_hint(raw: bytes) -> None:
    for piece in (TOKEN, TOKEN[:8], TOKEN[-8:], TOKEN.upper()):
        assert piece.encode() not in raw


def test_token_chain_of_processes_guards_everything_but_health() -> None:
    with processes() as procs:
        # The last node takes its token from the environment, the others by flag.
        (last_url,) = spawn_together(procs, ("meshnet_node", [], {"MESHNET_TOKEN": TOKEN}))
        relay_url, stranger_url = spawn_together(
            procs,
            ("meshnet_node", ["--token", TOKEN, "--next", last_url], None),
            # A relay with another token: it presents its own, which the last refuses.
            ("meshnet_node", ["--token", "other", "--next", last_url], None),
        )
        (gateway_url,) = spawn_together(
            procs, ("meshnet_gateway", ["--token", TOKEN, "--entry", relay_url], None)
        )

        for url in (gateway_url, relay_url, last_url):
            # With the token: the chunk goes through every hop (each presents it).
            valid_chunk_round_trip(url, token=TOKEN)
            good = requests_for(b"Bearer " + TOKEN.encode())
            key = None
            for name, data in good.items():
                if name == "delete" and key is not None:
                    # The gateway minted a key for the session the forward above
                    # created (wire-2 §3.9): without it the DELETE is refused and
                    # the session lives on; with it, the DELETE ends the session.
                    answer = send(url, data)
                    assert (answer.status, answer.code) == (403, "session_forbidden"), (
                        url,
                        answer.raw[:300],
                    )
                    assert_no_hint(answer.raw)
                    assert key not in answer.raw
                    data = data.replace(
                        b"\r\n\r\n", b"\r\nX-Meshnet-Session-Key: " + key + b"\r\n\r\n"
                    )
                answer = send(url, data)
                if name == "forward":
                    key = answer.headers.get(b"x-meshnet-session-key")
                    # Only the gateway mints keys; a node keeps an unkeyed session unkeyed.
                    assert (key is not None) == (url == gateway_url), (url, answer.raw[:300])
                # (delete ends the session the forward just above started: 204
                # proves the refused DELETE before it left the session alive)
                expected = {"delete": 204, "unknown_path": 404}.get(name, 200)
                assert answer.status == expected, (url, name, answer.raw[:300])
                assert_no_hint(answer.raw)
            for label, header in BAD_CREDENTIALS.items():
                # Every kind of bad credentials on /forward; two of them on
                # every endpoint (credentials are checked before the path).
                endpoints = requests_for(header)
                if label not in ("none", "wrong"):
                    endpoints = {"forward": endpoints["forward"], "health": endpoints["health"]}
                for name, data in endpoints.items():
                    answer = send(url, data)
                    assert_no_hint(answer.raw)
                    if name == "health":  # open; the deep one shows the chain: guarded
                        assert answer.status == 200, (url, label, name)
                        continue
                    assert (answer.status, answer.code) == (401, "unauthorized"), (
                        url,
                        label,
                        name,
                        answer.raw[:300],
                    )
                    assert answer.error["header"] == "authorization"
            # Two Authorization headers, one right: refused (no guessing which one).
            twice = request(
                [
                    *wire(new_session()),
                    (b"Authorization", b"Bearer " + TOKEN.encode()),
                    (b"Authorization", b"Bearer x"),
                ]
            )
            assert send(url, twice).status == 401

        answer = send(stranger_url, request(wire(new_session()), token="other"))
        assert (answer.status, answer.code) == (401, "unauthorized")
        assert answer.error["hop"] == last_url  # the downstream refused the relay's token
        assert_no_hint(answer.raw)
        # Its deep health names that, as a chain problem (wire-2 §6.2), not a 401.
        deep = send(stranger_url, requests_for(b"Bearer other")["health_deep"])
        health = json.loads(deep.raw.partition(b"\r\n\r\n")[2])
        assert deep.status == 200 and health["status"] == "cannot_serve", deep.raw[:400]
        assert [(p["code"], p["url"]) for p in health["problems"]] == [("token_mismatch", last_url)]
        for proc in procs:
            assert proc.poll() is None


def test_credentials_are_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(server_module.hmac, "compare_digest", spy)
    for header in (b"Bearer nope", b"Basic nope", b"Bearer " + TOKEN.encode()):
        conn = ServerConnection(token=TOKEN)
        conn.receive_data(
            b"GET /info HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + header + b"\r\n\r\n"
        )
        event = conn.next_event()
        assert event is not NEED_DATA
        assert isinstance(event, ProtocolErrorReceived) == (b"nope" in header)
    # Every attempt, even with a wrong scheme, went through the constant-time compare.
    assert [b for _, b in calls] == [TOKEN.encode()] * 3
    assert [a for a, _ in calls] == [b"nope", b"nope", TOKEN.encode()]


# ------------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA, a loopback certificate it signs, and an unrelated CA."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {
        "cert": root / "cert.pem",
        "key": root / "key.pem",
        "ca": root / "ca.pem",
        "other_ca": root / "other-ca.pem",
    }
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    other.cert_pem.write_to_path(str(paths["other_ca"]))
    return {name: str(path) for name, path in paths.items()}


def client_context(ca: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


def test_tls_chain_gateway_node_node_end_to_end(pki: dict[str, str], tmp_path: Path) -> None:
    serve = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--token", TOKEN]
    serve += ["--head-timeout", "2"]
    trusted = client_context(pki["ca"])
    with processes() as procs:
        (last_url,) = spawn_together(procs, ("meshnet_node", serve, None))
        relay_url, wary_url = spawn_together(
            procs,
            ("meshnet_node", [*serve, "--tls-ca", pki["ca"], "--next", last_url], None),
            # A node that trusts another CA must refuse the real downstream.
            ("meshnet_node", [*serve, "--tls-ca", pki["other_ca"], "--next", last_url], None),
        )
        (gateway_url,) = spawn_together(
            procs, ("meshnet_gateway", [*serve, "--tls-ca", pki["ca"], "--entry", relay_url], None)
        )
        assert all(u.startswith("https://") for u in (last_url, relay_url, gateway_url))

        for url in (gateway_url, relay_url, last_url):
            valid_chunk_round_trip(url, token=TOKEN, ssl_context=trusted)
        deep = get(gateway_url, "/health?deep=1", token=TOKEN, ssl_context=trusted)
        assert deep.status == 200 and b"downstream" in deep.body

        # `meshnet send` over TLS with --tls-ca and --token, through the whole chain.
        x = np.arange(3 * 16 * 8, dtype=np.float32).reshape(3, 16, 8)
        np.save(tmp_path / "in.npy", x)
        status = meshnet_main(
            [
                "send",
                "--gateway",
                gateway_url,
                "--tls-ca",
                pki["ca"],
                "--token",
                TOKEN,
                str(tmp_path / "in.npy"),
                str(tmp_path / "out.npy"),
            ]
        )
        assert status == 0
        assert np.load(tmp_path / "out.npy").tobytes() == x.tobytes()

        # A client with the wrong CA is refused, by certificate.
        for url in (gateway_url, relay_url):
            with pytest.raises(ssl.SSLCertVerificationError):
                exchange(
                    url, request(wire(new_session())), ssl_context=client_context(pki["other_ca"])
                )
        # Plain HTTP to a TLS port gets no HTTP answer.
        raw = exchange(relay_url.replace("https://", "http://"), request(wire(new_session())))
        assert not raw.startswith(b"HTTP/1.1 200")
        # A handshake that never finishes is bounded by the head timeout.
        sock = connect(relay_url.replace("https://", "http://"))
        with sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's start
            sock.settimeout(20)  # 10 x the head timeout
            with contextlib.suppress(ConnectionResetError):  # a reset is a close too
                assert sock.recv(65536) == b""
        # The node with the wrong CA does not talk to the downstream it cannot verify.
        answer = send(wary_url, request(wire(new_session()), token=TOKEN), ssl_context=trusted)
        assert (answer.status, answer.code) == (502, "downstream_unreachable")
        assert answer.error["hop"] == last_url
        # Everyone stays up and keeps serving.
        for url in (gateway_url, relay_url, last_url):
            valid_chunk_round_trip(url, token=TOKEN, ssl_context=trusted)
        for proc in procs:
            assert proc.poll() is None

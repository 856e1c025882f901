"""Credentials (wire-2 §7): the chain's tokens and clients' API keys, through
the core's public API and a ServerConnection fed bytes."""

from __future__ import annotations

import contextlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshnet_proto._credentials as credentials_module
from meshnet_proto import (
    NEED_DATA,
    EndpointRequest,
    ProtocolError,
    ProtocolErrorReceived,
    ServerConnection,
)
from meshnet_proto.lowlevel import CLIENT_PATHS, TENANT_NAME, Credentials, Principal, key_digest

TOKEN = "chain-token-0123456789"
OLD = "old-chain-token-98765"
ALICE = "mk-alice-key"
BOB = "mk-bob-key"


def creds() -> Credentials:
    return Credentials([TOKEN, OLD], {key_digest(ALICE): "alice", key_digest(BOB): "bob"})


def bearer(value: str | bytes) -> list[tuple[bytes, bytes]]:
    raw = value.encode() if isinstance(value, str) else value
    return [(b"authorization", raw)]


def refused(c: Credentials, headers: list[tuple[bytes, bytes]], path: str = "/v1/models",
            query: str = "") -> tuple[int, str]:  # fmt: skip
    with pytest.raises(ProtocolError) as caught:
        c.identify(headers, path, query)
    return caught.value.status, caught.value.code


def test_each_chain_token_opens_every_path_as_the_chain() -> None:
    c = creds()
    for token in (TOKEN, OLD):
        for path in ("/info", "/metrics", "/forward", "/v1/models", "/sessions/x"):
            principal = c.identify(bearer(f"Bearer {token}"), path, "")
            assert principal.chain and principal.tenant is None


def test_a_key_names_its_tenant_on_the_client_paths_only() -> None:
    c = creds()
    assert c.identify(bearer(f"Bearer {ALICE}"), "/v1/chat/completions", "") == Principal("alice")
    assert c.identify(bearer(f"bearer  {BOB} "), "/forward", "").tenant == "bob"
    assert c.identify(bearer(f"Bearer {BOB}"), "/sessions/abc", "").tenant == "bob"
    for path in ("/info", "/metrics", "/v1", "/v1/", "/kv/abc", "/drawn/x", "/forwardx"):
        assert refused(c, bearer(f"Bearer {ALICE}"), path) == (403, "key_not_allowed"), path
    assert refused(c, bearer(f"Bearer {ALICE}"), "/health", "deep=1") == (403, "key_not_allowed")


def test_a_wrong_missing_doubled_or_other_scheme_credential_is_401() -> None:
    c = creds()
    for headers in (
        [],
        bearer("Bearer nope"),
        bearer(f"Basic {TOKEN}"),
        bearer(f"Basic {ALICE}"),
        bearer(f"Bearer {ALICE.upper()}"),
        bearer(f"Bearer {key_digest(ALICE)}"),  # the digest is not the key
        bearer(f"Bearer {TOKEN}") + bearer(f"Bearer {TOKEN}"),
    ):
        assert refused(c, headers) == (401, "unauthorized")


def test_health_is_open_and_nothing_is_asked_without_credentials() -> None:
    c = creds()
    assert c.identify([], "/health", "").chain
    assert refused(c, [], "/health", "deep=1") == (401, "unauthorized")
    open_server = Credentials()
    assert not open_server.required and open_server.identify([], "/info", "").chain
    assert Credentials(api_keys={key_digest(ALICE): "alice"}).required


def test_replace_keys_revokes_and_adds_at_once() -> None:
    c = creds()
    c.replace_keys({key_digest("mk-carol"): "carol"})
    assert c.tenants == frozenset({"carol"})
    assert refused(c, bearer(f"Bearer {ALICE}")) == (401, "unauthorized")
    assert c.identify(bearer("Bearer mk-carol"), "/v1/models", "").tenant == "carol"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"ab": "alice"}, "SHA-256 hex digest"),
        ({key_digest("x").upper(): "alice"}, "SHA-256 hex digest"),
        ({key_digest("x"): "bad name"}, "tenant name"),
        ({key_digest("x"): ""}, "tenant name"),
        ({key_digest("x"): "a" * 65}, "tenant name"),
        ({1: "alice"}, "SHA-256 hex digest"),
        ({key_digest("x"): 7}, "tenant name"),
    ],
)
def test_bad_keys_are_refused_when_given(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Credentials(api_keys=keys)


def test_bad_chain_tokens_are_refused_when_given() -> None:
    for tokens in ([""], [None], [b"bytes"]):
        with pytest.raises(ValueError, match="chain token"):
            Credentials(tokens)  # type: ignore[arg-type]


def test_every_token_is_compared_in_constant_time_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append(bytes(b))
        return real(a, b)

    monkeypatch.setattr(credentials_module.hmac, "compare_digest", spy)
    c = creds()
    for value in ("Bearer nope", f"Bearer {TOKEN}", f"Bearer {ALICE}", f"Basic {OLD}"):
        with contextlib.suppress(ProtocolError):
            c.identify(bearer(value), "/v1/models", "")
    assert calls == [TOKEN.encode(), OLD.encode()] * 4


@given(st.text(min_size=1, max_size=80))
def test_tenant_names_are_one_bounded_charset(name: str) -> None:
    ok = TENANT_NAME.fullmatch(name) is not None
    assert ok == (
        len(name) <= 64
        and name[0].isascii()
        and name[0].isalnum()
        and all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in name)
    )


def test_client_paths_are_what_a_gateways_clients_use() -> None:
    assert CLIENT_PATHS == ("/v1/*", "/forward", "/sessions/*")
    c = Credentials(api_keys={key_digest(ALICE): "alice"}, client_paths=("/only",))
    assert c.identify(bearer(f"Bearer {ALICE}"), "/only", "").tenant == "alice"
    assert refused(c, bearer(f"Bearer {ALICE}"), "/forward") == (403, "key_not_allowed")


# ------------------------------------------------------------ the connection


def _head(conn: ServerConnection, target: bytes, credential: str | None) -> object:
    auth = b"" if credential is None else b"Authorization: Bearer " + credential.encode() + b"\r\n"
    conn.receive_data(b"GET " + target + b" HTTP/1.1\r\nHost: n\r\n" + auth + b"\r\n")
    return conn.next_event()


def test_a_connection_names_the_principal_of_each_request() -> None:
    conn = ServerConnection(credentials=creds(), routes={"/v1/models": {"GET"}, "/info": {"GET"}})
    event = _head(conn, b"/v1/models", ALICE)
    assert isinstance(event, EndpointRequest) and conn.principal == Principal("alice")
    conn.send_response(200)
    event = _head(conn, b"/info", TOKEN)
    assert isinstance(event, EndpointRequest) and conn.principal.chain
    conn.send_response(200)
    event = _head(conn, b"/info", ALICE)
    assert isinstance(event, ProtocolErrorReceived)
    assert (event.error.status, event.error.code) == (403, "key_not_allowed")


def test_a_head_check_runs_first_and_its_error_is_the_answer() -> None:
    seen: list[tuple[str, str, str]] = []

    def check(method: str, path: str, query: str, headers: object) -> None:
        seen.append((method, path, query))
        if path == "/refused":
            raise ProtocolError("no", code="host_not_allowed", status=403, header="host")

    conn = ServerConnection(token=TOKEN, head_check=check, routes={"/refused": {"GET"}})
    event = _head(conn, b"/refused?x=1", None)  # refused before its (missing) credentials
    assert isinstance(event, ProtocolErrorReceived) and event.error.code == "host_not_allowed"
    assert seen == [("GET", "/refused", "x=1")]
    answer = b"".join(bytes(piece) for piece in conn.send_error(event.error))
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "host_not_allowed"


def test_token_and_credentials_do_not_go_together() -> None:
    with pytest.raises(ValueError, match="not both"):
        ServerConnection(token=TOKEN, credentials=creds())
    assert _head(ServerConnection(token=TOKEN), b"/info", TOKEN) is not NEED_DATA


def test_a_cors_preflight_needs_no_credential_where_a_route_answers_it() -> None:
    routes = {"/v1/*": {"GET", "OPTIONS"}, "/info": {"GET"}}

    def head(method: bytes, target: bytes) -> object:
        conn = ServerConnection(credentials=creds(), routes=routes)
        conn.receive_data(method + b" " + target + b" HTTP/1.1\r\nHost: n\r\n\r\n")
        return conn.next_event()

    assert isinstance(head(b"OPTIONS", b"/v1/models"), EndpointRequest)
    for method, target in ((b"GET", b"/v1/models"), (b"OPTIONS", b"/info")):
        event = head(method, target)
        assert isinstance(event, ProtocolErrorReceived) and event.error.status == 401

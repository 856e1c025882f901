"""The gateway's browser policy on its own (meshnet_gateway.browser): reading
Host and Origin values, which the defaults and the flags allow, the head
check the wire-2 core runs, the CORS headers, JSON-only bodies, the flags.

Issue 37 ("a browser page can use a local gateway"): before, the gateway
served any Host and any Origin, and any body type on /v1.
"""

from __future__ import annotations

import argparse
import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_gateway.browser import (
    PREFLIGHT_MAX_AGE,
    BrowserPolicy,
    HostPort,
    host_list,
    is_json,
    origin_list,
    parse_host,
    parse_origin,
    preflight_headers,
    with_preflight,
)
from meshnet_gateway.config import GatewayConfig
from meshnet_proto import MeshnetError

DEFAULT = BrowserPolicy.build("127.0.0.1")

labels = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)
names = st.lists(labels, min_size=1, max_size=4).map(".".join)
ports = st.none() | st.integers(0, 65535)


def _case(text: str, upper: list[bool]) -> str:
    return "".join(
        c.upper() if u else c for c, u in zip(text, upper + [False] * len(text), strict=False)
    )


def head(**fields: str) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in fields.items()]


def refusal(
    policy: BrowserPolicy,
    headers: list[tuple[bytes, bytes]],
    path: str = "/v1/models",
    query: str = "",
) -> str | None:
    """The code ``check_head`` refuses with, None when it lets the head through."""
    try:
        policy.check_head("GET", path, query, headers)
    except MeshnetError as exc:
        return exc.code
    return None


# ---------------------------------------------------------------- reading values


@settings(max_examples=200, deadline=None)
@given(names, ports, st.lists(st.booleans()), st.booleans())
def test_a_host_name_reads_back_whatever_its_case(
    name: str, port: int | None, upper: list[bool], dot: bool
) -> None:
    text = _case(name, upper) + ("." if dot else "") + ("" if port is None else f":{port}")
    assert parse_host(text) == HostPort(name, port)


@settings(max_examples=200, deadline=None)
@given(st.ip_addresses(v=6), ports)
def test_an_ipv6_host_needs_its_brackets(address: ipaddress.IPv6Address, port: int | None) -> None:
    suffix = "" if port is None else f":{port}"
    assert parse_host(f"[{address.exploded.upper()}]{suffix}") == HostPort(address.compressed, port)
    assert parse_host(f"{address}{suffix}") is None


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60))
def test_any_text_reads_as_a_host_or_none_never_raises(text: str) -> None:
    host = parse_host(text)
    assert host is None or (host.name and (host.port is None or 0 <= host.port <= 65535))
    origin = parse_origin(text)
    assert origin is None or origin.serialized() == origin.serialized().lower()


@pytest.mark.parametrize(
    "text",
    [
        "",
        ":80",
        "a b",
        "evil.example:80:80",
        "evil.example:http",
        "evil.example:99999",
        "::1",
        "[::1",
        "[::1]x",
        "[1.2.3.4]",
        "[fe80::1%25eth0]",
        "evil/example",
        "évil.example",
        "a..b",
    ],
)
def test_what_is_no_host_value(text: str) -> None:
    assert parse_host(text) is None


@pytest.mark.parametrize(
    ("text", "serialized"),
    [
        ("http://localhost:3000", "http://localhost:3000"),
        ("HTTPS://App.Example.COM:443", "https://app.example.com"),
        ("http://[0:0::1]:80", "http://[::1]"),
        ("chrome-extension://abcdef", "chrome-extension://abcdef"),
    ],
)
def test_an_origin_reads_as_a_browser_writes_it(text: str, serialized: str) -> None:
    origin = parse_origin(text)
    assert origin is not None and origin.serialized() == serialized


@pytest.mark.parametrize("text", ["null", "localhost", "http://", "http://a/b", "http//a", "1://a"])
def test_what_is_no_origin(text: str) -> None:
    assert parse_origin(text) is None


# ---------------------------------------------------------------- Host


@settings(max_examples=200, deadline=None)
@given(names, ports)
def test_by_default_a_name_other_than_localhost_is_refused(name: str, port: int | None) -> None:
    text = name if port is None else f"{name}:{port}"
    expected = name == "localhost" or _is_ip(name)
    assert DEFAULT.host_allowed(text) is expected
    assert BrowserPolicy.build("127.0.0.1", allowed_hosts=[name]).host_allowed(text)
    assert BrowserPolicy.build("127.0.0.1", allowed_hosts=["*"]).host_allowed(text)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(st.ip_addresses(), ports)
def test_an_address_is_always_served_no_rebinding_goes_through_one(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int | None
) -> None:
    text = f"[{address}]" if address.version == 6 else str(address)
    assert DEFAULT.host_allowed(text if port is None else f"{text}:{port}")


def test_the_bound_name_is_served_a_wildcard_address_names_nothing() -> None:
    bound = BrowserPolicy.build("Gpu-Box.lan")
    assert bound.host_allowed("gpu-box.lan:8000") and bound.origin_allowed(
        "http://gpu-box.lan:3000"
    )
    assert not DEFAULT.host_allowed("gpu-box.lan:8000")
    for wildcard in ("0.0.0.0", "::", "[::]"):
        policy = BrowserPolicy.build(wildcard)
        assert policy.names == frozenset()
        assert policy.host_allowed("192.168.1.5:8000")  # a LAN client by address
        assert not policy.origin_allowed("http://0.0.0.0:8000")
    assert BrowserPolicy.build("::1").names == frozenset({"::1"})
    assert BrowserPolicy.build("192.168.1.5").origin_allowed("http://192.168.1.5:3000")


# ---------------------------------------------------------------- Origin


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost",
        "http://localhost:3000",
        "https://localhost:8443",
        "http://127.0.0.1:5173",
        "http://127.8.9.10",
        "http://[::1]:8000",
        "HTTP://LOCALHOST:1",
    ],
)
def test_by_default_the_gateways_own_names_may_call_it_on_any_port(origin: str) -> None:
    assert DEFAULT.origin_allowed(origin)


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.example",
        "http://evil.example:8000",
        "null",
        "file://",
        "http://1.2.3.4",
        "http://192.168.1.5:3000",
        "ftp://localhost",
        "http://localhost.evil.example",
        "",
    ],
)
def test_by_default_another_origin_may_not(origin: str) -> None:
    assert not DEFAULT.origin_allowed(origin)


def test_allowed_origins_are_exact_and_star_is_any() -> None:
    policy = BrowserPolicy.build(
        "127.0.0.1", allowed_origins=origin_list("https://app.example.com")
    )
    assert policy.origin_allowed("https://app.example.com")
    assert policy.origin_allowed("https://APP.example.com:443")
    assert not policy.origin_allowed("http://app.example.com")
    assert not policy.origin_allowed("https://app.example.com:8443")
    assert not policy.origin_allowed("https://other.example.com")
    anyone = BrowserPolicy.build("127.0.0.1", allowed_origins=["*"])
    assert anyone.origin_allowed("https://evil.example") and anyone.origin_allowed("null")
    hosts = BrowserPolicy.build("127.0.0.1", allowed_hosts=["gw.example"])
    assert hosts.origin_allowed("https://gw.example") and not hosts.origin_allowed("https://x.y")


# ---------------------------------------------------------------- the head check


def test_the_head_check_refuses_a_rebinding_and_a_cross_site_request() -> None:
    assert refusal(DEFAULT, head(host="localhost:8000")) is None
    assert refusal(DEFAULT, head(host="127.0.0.1:8000", origin="http://localhost:3000")) is None
    assert refusal(DEFAULT, head(host="evil.example:8000")) == "host_not_allowed"
    assert refusal(DEFAULT, head(host="EVIL.example")) == "host_not_allowed"
    evil = head(host="localhost", origin="https://evil.example")
    assert refusal(DEFAULT, evil) == "origin_not_allowed"
    assert refusal(DEFAULT, evil, path="/forward") == "origin_not_allowed"
    assert refusal(DEFAULT, head(host="bad host")) == "host_not_allowed"
    # HTTP/1.0 without Host: not a browser (every browser sends Host).
    assert refusal(DEFAULT, []) is None
    twice = [(b"host", b"localhost"), (b"host", b"evil.example")]
    assert refusal(DEFAULT, twice) == "duplicate_header"
    assert refusal(DEFAULT, [*head(host="localhost"), (b"origin", b"x"), (b"origin", b"y")]) == (
        "duplicate_header"
    )
    # Latin-1 bytes h11 lets through are no name.
    assert refusal(DEFAULT, [(b"host", "évil".encode())]) == "host_not_allowed"


def test_plain_health_stays_open_a_deep_one_is_checked() -> None:
    evil = head(host="evil.example", origin="https://evil.example")
    assert refusal(DEFAULT, evil, path="/health") is None
    assert refusal(DEFAULT, evil, path="/health", query="deep=1") == "host_not_allowed"


def test_the_refusals_are_403_with_their_header() -> None:
    with pytest.raises(MeshnetError) as caught:
        DEFAULT.check_head("GET", "/info", "", head(host="evil.example"))
    assert (caught.value.status, caught.value.header) == (403, "host")
    with pytest.raises(MeshnetError) as caught:
        DEFAULT.check_head("POST", "/v1/completions", "", head(origin="https://evil.example"))
    assert (caught.value.status, caught.value.header) == (403, "origin")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([b"host", b"origin", b"x"]), st.binary(max_size=40)), max_size=4
    )
)
def test_the_head_check_answers_any_head_with_a_known_code(
    headers: list[tuple[bytes, bytes]],
) -> None:
    assert refusal(DEFAULT, headers) in (
        None,
        "host_not_allowed",
        "origin_not_allowed",
        "duplicate_header",
    )


def test_cors_origin_grants_an_allowed_origin_only() -> None:
    assert DEFAULT.cors_origin(head(origin="http://localhost:3000")) == "http://localhost:3000"
    assert DEFAULT.cors_origin(head(origin="https://evil.example")) is None
    assert DEFAULT.cors_origin(head(host="localhost")) is None


# ---------------------------------------------------------------- CORS and bodies


def test_a_preflight_names_the_origin_methods_headers_and_age() -> None:
    pairs = dict(
        preflight_headers("http://localhost:3000", ["POST"], "Content-Type, X-Stainless-OS")
    )
    assert pairs[b"access-control-allow-origin"] == b"http://localhost:3000"
    assert pairs[b"access-control-allow-methods"] == b"OPTIONS, POST"
    assert pairs[b"access-control-allow-headers"] == b"authorization, content-type, x-stainless-os"
    assert pairs[b"access-control-max-age"] == str(PREFLIGHT_MAX_AGE).encode()
    assert pairs[b"vary"] == b"Origin"
    odd = dict(preflight_headers("http://localhost", ["GET"], "bad header, (x)"))
    assert odd[b"access-control-allow-headers"] == b"authorization, content-type"
    assert preflight_headers(None, ["GET"], None) == [(b"allow", b"GET, OPTIONS")]
    assert with_preflight({"/v1/models": ("GET",)}) == {"/v1/models": ("GET", "OPTIONS")}


@pytest.mark.parametrize(
    ("types", "ok"),
    [
        (["application/json"], True),
        (["Application/JSON; charset=utf-8"], True),
        (["application/json ;charset=UTF-8"], True),
        ([], False),
        (["text/plain"], False),
        (["application/x-www-form-urlencoded"], False),
        (["multipart/form-data; boundary=x"], False),
        (["application/jsonx"], False),
        (["application/json", "application/json"], False),
    ],
)
def test_only_a_json_body_is_a_generation_request(types: list[str], ok: bool) -> None:
    assert is_json(types) is ok


# ---------------------------------------------------------------- the flags


def test_the_flags_read_names_and_origins() -> None:
    assert host_list(" Gw.Example. , *,,") == ("gw.example", "*")
    assert host_list("") == ()
    assert origin_list("https://App.example.com/, http://localhost:3000,*") == (
        "https://app.example.com",
        "http://localhost:3000",
        "*",
    )
    for bad in ("gw.example:8000", "http://gw.example", "a b"):
        with pytest.raises(argparse.ArgumentTypeError):
            host_list(bad)
    for bad in ("null", "app.example.com", "https://app.example.com/path"):
        with pytest.raises(argparse.ArgumentTypeError):
            origin_list(bad)


def test_the_gateway_takes_them_as_flags_and_from_the_environment() -> None:
    entry = ["--entry", "http://127.0.0.1:9"]
    assert GatewayConfig.load(entry, {}).allowed_hosts == ()
    config = GatewayConfig.load(
        [*entry, "--allowed-hosts", "gw.example"],
        {"MESHNET_ALLOWED_ORIGINS": "https://app.example.com"},
    )
    assert config.allowed_hosts == ("gw.example",)
    assert config.allowed_origins == ("https://app.example.com",)
    with pytest.raises(SystemExit):
        GatewayConfig.load([*entry, "--allowed-origins", "null"], {})

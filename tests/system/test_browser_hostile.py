"""A web page against a local gateway, over real processes (issue 37, "a
browser page can use a local gateway").

Two model nodes and a gateway with ``--model`` on 127.0.0.1, defaults; two
more gateways over the same nodes with the browser flags. Each request is
what a browser sends for a hostile page:

* DNS rebinding: the page's name resolves to 127.0.0.1, so its requests
  reach the gateway same-origin, with ``Host: evil.example:PORT``;
* a cross-site request: ``Origin: https://evil.example``, a POST or its
  preflight;
* a "simple" cross-site POST (no preflight): a ``text/plain``, form or
  type-less body.

Before this change every one of them was served (200; the preflight was 405
and the simple POST needed none); the flags did not exist. Now: 403
``host_not_allowed`` / ``origin_not_allowed``, 415, and an allowed origin
gets its preflight (204) and ``Access-Control-Allow-Origin`` on its answers.
The control row (no Origin, Host localhost) is served as before, and
nothing refused reaches a node.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.gateway import stop
from support.model_surface import (
    QUESTION,
    ModelChain,
    answer_text,
    info,
    model_chain,
    spawn_logged,
    wait_for,
    write_model,
)
from support.security import Answer, request, send, wire

EVIL = b"https://evil.example"
LOCAL_PAGE = b"http://localhost:5173"  # a dev server on the same machine
APP = b"https://app.example.com"
JSON = (b"Content-Type", b"application/json")


@dataclass
class Gateways:
    chain: ModelChain
    named: str  # --allowed-hosts gw.example --allowed-origins https://app.example.com
    anyhost: str  # --allowed-hosts '*' --allowed-origins '*'
    logs: list[Path]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    root = tmp_path_factory.mktemp("browser")
    model_dir = write_model(root / "m")
    with model_chain(model_dir, root) as chain, contextlib.ExitStack() as stack:
        chain.answer = answer_text(ask(chain.gateway))
        urls = []
        flags = (
            ["--allowed-hosts", "gw.example", "--allowed-origins", APP.decode()],
            ["--allowed-hosts", "*", "--allowed-origins", "*"],
        )
        for index, extra in enumerate(flags):
            log = root / f"gateway{index}.log"
            args = ["--entry", chain.nodes[0], "--model", str(model_dir), *extra]
            proc, url = spawn_logged("meshnet_gateway", args, log)
            stack.callback(_stopped, proc, log)
            urls.append(url)
        logs = [chain.logs["gateway"], root / "gateway0.log", root / "gateway1.log"]
        yield Gateways(chain, urls[0], urls[1], logs)


def _stopped(proc: subprocess.Popen[str], log: Path) -> None:
    assert stop(proc) == 0, log.read_text()[-2000:]


def question(model: str, **extra: object) -> bytes:
    return json.dumps({**QUESTION, "model": model, **extra}).encode()


def post(
    url: str, target: bytes, body: bytes, *pairs: tuple[bytes, bytes], host: bytes = b"localhost"
) -> Answer:
    """A POST with ``pairs`` (no Content-Type unless they name one)."""
    data = request(list(pairs), body, target=target, host=host)
    return send(url, data, timeout=120, half_close=False)


def chat(url: str, *pairs: tuple[bytes, bytes], host: bytes = b"localhost") -> Answer:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "temperature": 0,
        }
    ).encode()
    return post(url, b"/v1/chat/completions", body, *pairs, host=host)


def ask(url: str, *pairs: tuple[bytes, bytes], host: bytes = b"localhost", **extra) -> Answer:
    return post(url, b"/v1/completions", question("m", **extra), JSON, *pairs, host=host)


def other(
    url: str, method: bytes, target: bytes, *pairs: tuple[bytes, bytes], host: bytes = b"localhost"
) -> Answer:
    data = request(list(pairs), b"", method=method, target=target, host=host, length=None)
    return send(url, data, timeout=60, half_close=False)


def preflight(url: str, origin: bytes, host: bytes = b"localhost") -> Answer:
    return other(
        url,
        b"OPTIONS",
        b"/v1/chat/completions",
        (b"Origin", origin),
        (b"Access-Control-Request-Method", b"POST"),
        (b"Access-Control-Request-Headers", b"authorization, content-type"),
        host=host,
    )


def refused(answer: Answer, status: int, code: str) -> None:
    assert (answer.status, answer.code) == (status, code), answer.raw[:400]
    assert b"access-control-allow-origin" not in answer.headers


def test_a_rebinding_page_is_refused_on_every_path(gateways: Gateways) -> None:
    url, evil = gateways.chain.gateway, b"evil.example:8000"
    refused(other(url, b"GET", b"/v1/models", host=evil), 403, "host_not_allowed")
    refused(chat(url, JSON, host=evil), 403, "host_not_allowed")
    forward = request(wire(None), host=evil)
    refused(send(url, forward, timeout=60, half_close=False), 403, "host_not_allowed")
    refused(other(url, b"GET", b"/info", host=b"EVIL.example"), 403, "host_not_allowed")
    refused(other(url, b"GET", b"/metrics", host=b"127.0.0.1.nip.io"), 403, "host_not_allowed")


def test_a_cross_site_request_is_refused_and_so_is_its_preflight(gateways: Gateways) -> None:
    url = gateways.chain.gateway
    refused(chat(url, JSON, (b"Origin", EVIL)), 403, "origin_not_allowed")
    refused(preflight(url, EVIL), 403, "origin_not_allowed")
    refused(ask(url, (b"Origin", b"null")), 403, "origin_not_allowed")
    refused(ask(url, (b"Origin", APP)), 403, "origin_not_allowed")  # only with the flag
    forward = request([*wire(None), (b"Origin", EVIL)])
    refused(send(url, forward, timeout=60, half_close=False), 403, "origin_not_allowed")


@pytest.mark.parametrize(
    "content_type",
    [
        b"text/plain",
        b"text/plain;charset=UTF-8",
        b"application/x-www-form-urlencoded",
        b"multipart/form-data; boundary=x",
        None,
    ],
)
def test_a_body_a_page_may_post_without_a_preflight_is_415(
    gateways: Gateways, content_type: bytes | None
) -> None:
    pairs = [] if content_type is None else [(b"Content-Type", content_type)]
    for target in (b"/v1/completions", b"/v1/chat/completions"):
        answer = post(gateways.chain.gateway, target, question("m"), *pairs)
        assert answer.status == 415, answer.raw[:400]
        error = answer.error
        assert (
            error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
        )
        assert "Content-Type: application/json" in error["message"]


def test_an_allowed_origin_gets_its_preflight_and_readable_answers(gateways: Gateways) -> None:
    url = gateways.chain.gateway
    answer = preflight(url, LOCAL_PAGE, host=b"127.0.0.1:1")
    assert answer.status == 204, answer.raw[:400]
    assert answer.headers[b"access-control-allow-origin"] == LOCAL_PAGE
    assert b"POST" in answer.headers[b"access-control-allow-methods"]
    allowed = answer.headers[b"access-control-allow-headers"]
    assert b"authorization" in allowed and b"content-type" in allowed
    assert int(answer.headers[b"access-control-max-age"]) > 0
    assert answer.headers[b"vary"] == b"Origin"
    answer = ask(url, (b"Origin", LOCAL_PAGE))
    assert answer_text(answer) == gateways.chain.answer
    assert answer.headers[b"access-control-allow-origin"] == LOCAL_PAGE
    assert answer.headers[b"vary"] == b"Origin"
    streamed = ask(url, (b"Origin", LOCAL_PAGE), stream=True)
    assert streamed.status == 200 and b"data: [DONE]" in streamed.raw, streamed.raw[:400]
    assert streamed.headers[b"access-control-allow-origin"] == LOCAL_PAGE
    # A 415 the page can read (its developer sees why).
    typed = post(url, b"/v1/completions", question("m"), (b"Origin", LOCAL_PAGE))
    assert typed.status == 415 and typed.headers[b"access-control-allow-origin"] == LOCAL_PAGE


def test_without_an_origin_the_gateway_serves_as_before(gateways: Gateways) -> None:
    chain = gateways.chain
    assert answer_text(ask(chain.gateway)) == chain.answer
    assert answer_text(ask(chain.gateway, host=b"127.0.0.1:9")) == chain.answer
    models = other(chain.gateway, b"GET", b"/v1/models", host=b"[::1]:8000")
    assert models.status == 200 and b"access-control-allow-origin" not in models.headers
    # Nothing refused above holds anything at a node, and the gateway logged no traceback.
    assert wait_for(lambda: all(info(node)["sessions"] == 0 for node in chain.nodes))
    for log in gateways.logs:
        assert "Traceback" not in log.read_text()


def test_the_flags_allow_a_proxy_name_and_an_app_origin(gateways: Gateways) -> None:
    named, anyhost = gateways.named, gateways.anyhost
    answer = other(named, b"GET", b"/v1/models", host=b"GW.example:443")
    assert answer.status == 200, answer.raw[:400]
    refused(other(named, b"GET", b"/v1/models", host=b"evil.example"), 403, "host_not_allowed")
    answer = preflight(named, APP)
    assert answer.status == 204 and answer.headers[b"access-control-allow-origin"] == APP
    answer = ask(named, (b"Origin", APP))
    assert answer_text(answer) == gateways.chain.answer
    assert answer.headers[b"access-control-allow-origin"] == APP
    own = ask(named, (b"Origin", b"https://gw.example"), host=b"gw.example")
    assert own.headers[b"access-control-allow-origin"] == b"https://gw.example"
    refused(ask(named, (b"Origin", EVIL)), 403, "origin_not_allowed")
    # '*': any Host, any Origin (a proxy in front checks them itself).
    answer = ask(anyhost, (b"Origin", EVIL), host=b"evil.example:8000")
    assert answer_text(answer) == gateways.chain.answer
    assert answer.headers[b"access-control-allow-origin"] == EVIL
    # Still JSON only.
    assert post(anyhost, b"/v1/completions", question("m"), (b"Origin", EVIL)).status == 415

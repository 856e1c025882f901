"""The gateway's access log and its serving metrics, read back as an operator reads them.

Issue 22 ("Why" 4): at the default level a gateway logged nothing per
request, and ``/metrics`` had no TTFT, per-token latency or token counters
under names a Prometheus user of vLLM queries. Here a real chain of
processes (two model nodes and a gateway with ``--model``, at its default
log level) serves a completion, a streamed chat and a health check; the
gateway's stderr is parsed line by line and its ``/metrics`` with
prometheus_client's parser, and both must agree with the answers' ``usage``.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gateway import forward_via_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_proto import MeshnetError
from support.gateway import activation
from support.model_surface import model_chain, write_model
from support.openai import serve_openai, write_model_dir
from support.waiting import wait_until

# One access line: peer, "METHOD TARGET", status, then key=value fields.
ACCESS = re.compile(
    r'meshnet\.access: (?P<peer>\S+) "(?P<method>[A-Z]+) (?P<target>\S+)" (?P<status>\d{3})'
    r"(?P<fields>(?: \S+)*)$"
)
LIMIT = 120  # seconds: only ends a hung test


@dataclass
class Line:
    peer: str
    method: str
    target: str
    status: int
    fields: dict[str, str]
    flags: list[str]


def access_lines(text: str) -> list[Line]:
    lines = []
    for raw in text.splitlines():
        match = ACCESS.search(raw)
        if match is None:
            continue
        fields, flags = {}, []
        for part in match["fields"].split():
            name, sep, value = part.partition("=")
            if sep:
                fields[name] = value
            else:
                flags.append(part)
        lines.append(Line(match["peer"], match["method"], match["target"],
                          int(match["status"]), fields, flags))  # fmt: skip
    return lines


def seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


def _connection(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    assert parts.hostname is not None
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=LIMIT)


def post_json(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = _connection(url)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post_stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's events (the JSON ones; ``[DONE]`` must end them)."""
    conn = _connection(url)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = [e.removeprefix("data: ") for e in response.read().decode().split("\n\n") if e]
    finally:
        conn.close()
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def get(url: str, target: str) -> tuple[int, bytes]:
    conn = _connection(url)
    try:
        conn.request("GET", target)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics body, by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@dataclass
class Served:
    model: str
    usages: list[dict[str, int]]  # the completion's, then the chat's
    log: str
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A chain of real processes; the gateway at its default log level (info)."""
    root = tmp_path_factory.mktemp("access")
    model_dir = write_model(root / "tiny")
    usages = []
    with model_chain(model_dir, root, gateway_flags=["--log-level", "info"]) as chain:
        status, whole = post_json(chain.gateway, "/v1/completions",
                                  {"model": chain.model, "prompt": "hello world",
                                   "max_tokens": 5, "temperature": 0})  # fmt: skip
        assert status == 200, whole
        usages.append(whole["usage"])
        events = post_stream(
            chain.gateway,
            "/v1/chat/completions",
            {"model": chain.model, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 7, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}},
        )  # fmt: skip
        usages.append(events[-1]["usage"])
        assert get(chain.gateway, "/health")[0] == 200
        status, body = get(chain.gateway, "/metrics")
        assert status == 200
        metrics = samples(body.decode())
    # The processes have exited (model_chain stops them): the log is complete.
    yield Served(chain.model, usages, chain.logs["gateway"].read_text(), metrics)


def test_each_request_is_one_line_at_the_default_level(served: Served) -> None:
    lines = access_lines(served.log)
    completion, chat, health, metrics = lines
    assert (completion.method, completion.target, completion.status) == (
        "POST", "/v1/completions", 200,
    )  # fmt: skip
    assert (chat.method, chat.target, chat.status) == ("POST", "/v1/chat/completions", 200)
    for line, usage in ((completion, served.usages[0]), (chat, served.usages[1])):
        assert line.peer == "127.0.0.1"
        assert int(line.fields["prompt_tokens"]) == usage["prompt_tokens"]
        assert int(line.fields["completion_tokens"]) == usage["completion_tokens"]
        ttft, duration = seconds(line.fields["ttft"]), seconds(line.fields["duration"])
        assert 0 <= ttft <= duration
        assert float(line.fields["tok/s"]) > 0  # 5 and 7 tokens: a decode rate exists
        assert line.flags == []
    # Other paths: method, path, status and duration only.
    assert (health.method, health.target, health.status) == ("GET", "/health", 200)
    assert set(health.fields) == {"duration"}
    assert (metrics.target, set(metrics.fields)) == ("/metrics", {"duration"})


def test_serving_metrics_count_what_was_generated(served: Served) -> None:
    """vLLM's metric set under meshnet_ names: the counters equal the answers'
    usage, each histogram counted once per request (or per token gap)."""
    model = (("model_name", served.model),)
    value = served.metrics.get
    prompt = sum(u["prompt_tokens"] for u in served.usages)
    generated = sum(u["completion_tokens"] for u in served.usages)
    assert value(("meshnet_prompt_tokens_total", model)) == prompt
    assert value(("meshnet_generation_tokens_total", model)) == generated
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                 "request_prefill_time", "request_decode_time"):  # fmt: skip
        assert value((f"meshnet_{name}_seconds_count", model)) == 2, name
    # One inter-token gap per token after each generation's first.
    gaps = generated - len(served.usages)
    assert value(("meshnet_time_per_output_token_seconds_count", model)) == gaps
    assert value(("meshnet_inter_token_latency_seconds_count", model)) == gaps
    assert value(("meshnet_request_generation_tokens_sum", model)) == generated
    assert value(("meshnet_request_prompt_tokens_sum", model)) == prompt
    finished = (("finished_reason", "length"), ("model_name", served.model))
    assert value(("meshnet_request_success_total", finished)) == 2
    # Nothing runs or waits once both answers are in.
    assert value(("meshnet_num_requests_running", model)) == 0
    assert value(("meshnet_num_requests_waiting", model)) == 0


# ---------------------------------------------------------------- in process


@pytest.mark.anyio
@pytest.mark.parametrize("off", [False, True], ids=["default", "no-access-log"])
async def test_no_access_log_turns_it_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, off: bool
) -> None:
    """``--no-access-log``: no line (the same code path as the process's;
    the level is the process's default, info)."""
    model_dir = write_model_dir(tmp_path / "tiny")
    flags = ["--no-access-log"] if off else []
    caplog.set_level(logging.INFO, logger="meshnet.access")
    async with serve_openai(model_dir, gateway_flags=flags) as served:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        with anyio.fail_after(LIMIT):
            status, _ = await anyio.to_thread.run_sync(
                post_json, served.url, "/v1/completions", body
            )
            assert status == 200
            assert (await anyio.to_thread.run_sync(get, served.url, "/info"))[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "meshnet.access"]
    if off:
        assert lines == []
    else:
        assert [line.split('"')[1] for line in lines] == ["POST /v1/completions", "GET /info"]


def test_the_switch_reads_its_variable_and_refuses_a_bad_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    entry = ["--entry", "http://127.0.0.1:1"]
    assert GatewayConfig.load(entry, {}).no_access_log is False
    assert GatewayConfig.load(entry, {"MESHNET_NO_ACCESS_LOG": "1"}).no_access_log is True
    assert GatewayConfig.load([*entry, "--no-access-log"], {}).no_access_log is True
    # The flag beats the variable, as every flag does.
    flag_off = GatewayConfig.load([*entry, "--no-access-log=false"], {"MESHNET_NO_ACCESS_LOG": "1"})
    assert flag_off.no_access_log is False
    with pytest.raises(SystemExit) as exited:
        GatewayConfig.load(entry, {"MESHNET_NO_ACCESS_LOG": "sometimes"})
    assert exited.value.code == 2
    assert "MESHNET_NO_ACCESS_LOG" in capsys.readouterr().err


@pytest.mark.anyio
async def test_refusals_and_forward_have_their_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused /v1 request is logged with its status and no token fields
    (it never reached the chain); a wire-2 /forward with its status too."""
    model_dir = write_model_dir(tmp_path / "tiny")
    caplog.set_level(logging.INFO, logger="meshnet.access")
    async with serve_openai(model_dir, stages=1) as served:
        with anyio.fail_after(LIMIT):
            status, _ = await anyio.to_thread.run_sync(
                post_json, served.url, "/v1/completions", {"model": "nope", "prompt": "x"}
            )
            assert status == 404
            with pytest.raises(MeshnetError):
                # A model node takes int32 ids: bfloat16 hidden states are refused (400).
                await forward_via_gateway(served.url, activation(4, 8))
    logged = [r.getMessage() for r in caplog.records if r.name == "meshnet.access"]
    lines = access_lines("\n".join(f"meshnet.access: {message}" for message in logged))
    refused, forward = lines
    assert (refused.target, refused.status, set(refused.fields)) == (
        "/v1/completions", 404, {"duration"},
    )  # fmt: skip
    assert forward.target == "/forward" and 400 <= forward.status < 500


async def _leave(url: str, body: dict[str, Any], *, until: Any) -> None:
    """POST ``body`` over a raw socket, wait until ``until(received)``, hang up
    (a whole answer sends nothing before its end: ``until`` is polled then)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    stream = await anyio.connect_tcp(host, int(port))
    await stream.send(head + data)
    if body["stream"]:
        seen = b""
        while not until(seen):
            seen += await stream.receive()
    else:
        await wait_until(lambda: until(b""), "the generation under way")
    await stream.aclose()


async def _line_of(caplog: pytest.LogCaptureFixture) -> Line:
    """The one access line, once written (bounded: ``LIMIT`` ends a hang)."""
    lines: list[Line] = []

    def written() -> bool:
        logged = [r.getMessage() for r in caplog.records if r.name == "meshnet.access"]
        if logged:
            lines.extend(access_lines("\n".join(f"meshnet.access: {m}" for m in logged)))
        return bool(logged)

    await wait_until(written, "the access line")
    (line,) = lines
    return line


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_client_that_leaves_is_logged_as_such(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Mid-stream: the 200 is out, the line says ``client_left`` with the tokens
    generated so far; before a whole answer: status 499, nginx's."""
    from support.openai import fake_stages

    stages = fake_stages(2)
    stages[-1].delay_ms = 20.0  # 200 steps: seconds, the client leaves long before
    caplog.set_level(logging.INFO, logger="meshnet.access")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "stream": stream}
    async with serve_openai(write_model_dir(tmp_path / "tiny"), stages=stages) as served:
        with anyio.fail_after(LIMIT):
            if stream:
                await _leave(served.url, body, until=lambda seen: seen.count(b"data: ") >= 3)
            else:
                calls = stages[-1].calls
                await _leave(served.url, body, until=lambda seen: stages[-1].calls >= calls + 5)
            line = await _line_of(caplog)
    if stream:
        assert (line.status, line.flags) == (200, ["client_left"])
        assert 2 <= int(line.fields["completion_tokens"]) < 200
    else:
        assert (line.status, line.flags) == (499, [])
    assert line.target == "/v1/completions"

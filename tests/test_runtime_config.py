"""Endpoints, configuration, metrics and deadlines of meshnet_runtime."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_proto import DownstreamError, Limits
from meshnet_runtime.config import env_name, load_config
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.endpoints import format_url, parse_endpoint
from meshnet_runtime.http_server import ServerSettings
from meshnet_runtime.lifecycle import server_settings
from meshnet_runtime.metrics import ServerMetrics, endpoint_label


@pytest.mark.parametrize(
    ("url", "scheme", "host", "port", "path"),
    [
        ("http://127.0.0.1:8001", "http", "127.0.0.1", 8001, None),
        ("https://node-2.local:443", "https", "node-2.local", 443, None),
        ("http://[::1]:9000", "http", "::1", 9000, None),
        ("http://host:1/", "http", "host", 1, None),
        ("unix:/run/meshnet/n1.sock", "unix", None, None, "/run/meshnet/n1.sock"),
        ("unix:///tmp/x.sock", "unix", None, None, "/tmp/x.sock"),
    ],
)
def test_parse_endpoint(url: str, scheme: str, host: str, port: int, path: str) -> None:
    ep = parse_endpoint(url)
    assert (ep.url, ep.scheme, ep.host, ep.port, ep.path) == (url, scheme, host, port, path)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "127.0.0.1:8000",
        "ftp://h:1",
        "http://h",
        "http://h:0",
        "http://h:65536",
        "http://h:\uff18\uff10",  # fullwidth digits
        "http://h:80/forward",
        "http://u@h:80",
        "http://::1:80",
        "http://[::1:80",
        "http://[nothex]:80",
        "unix:relative.sock",
        " http://h:1",
    ],
)
def test_parse_endpoint_rejects(url: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        parse_endpoint(url)


def test_authority_and_format() -> None:
    assert parse_endpoint("http://[::1]:9000").authority == "[::1]:9000"
    assert parse_endpoint("unix:/a.sock").authority == "localhost"
    assert format_url("https", "::1", 1) == "https://[::1]:1"
    assert format_url("unix", path="/a.sock") == "unix:/a.sock"


def test_config_precedence_flag_env_default() -> None:
    env = {"MESHNET_TIMEOUT": "5", "MESHNET_CHUNK_TOKENS": "64", "MESHNET_ENTRY": "http://a:1"}
    config = load_config("gateway", ["--timeout", "7"], env)
    assert config.timeout == 7.0  # flag beats env
    assert config.chunk_tokens == 64  # env beats default
    assert config.inflight == 1  # default
    assert config.entry is not None and config.entry.port == 1
    assert env_name("--chunk-tokens") == "MESHNET_CHUNK_TOKENS"


def test_config_node_flags() -> None:
    config = load_config(
        "node",
        ["--next", "unix:/tmp/n.sock", "--backend", "zeros", "--delay-ms", "2.5",
         "--wire-dtype", "auto-lossless", "--encoding", "zstd", "--zstd-level", "3"],
        {},
    )  # fmt: skip
    assert config.next is not None and config.next.scheme == "unix"
    assert (config.backend, config.delay_ms) == ("zeros", 2.5)
    assert (config.wire_dtype, config.encoding, config.zstd_level) == ("auto-lossless", "zstd", 3)
    assert config.limits.reorder_window == 16
    assert "s3cret" not in repr(load_config("node", ["--token", "s3cret"], {}))


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "-1"], {}, "--port"),
        (["--encoding", "gzip"], {}, "--encoding"),
        (["--wire-dtype", "Float32"], {}, "--wire-dtype"),
        ([], {"MESHNET_MAX_SESSIONS": "0"}, "MESHNET_MAX_SESSIONS"),
        ([], {"MESHNET_NEXT": "localhost:80"}, "MESHNET_NEXT"),
        (["--tls-cert", "c.pem"], {}, "--tls-key"),
        (["--timeout", "nan"], {}, "--timeout"),
        (["--zstd-level", "99"], {}, "--zstd-level"),
    ],
)
def test_config_rejects(
    argv: list[str], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config("node", argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_gateway_requires_entry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config("gateway", [], {})
    assert "--entry" in capsys.readouterr().err


def test_metrics_render_parses_and_registries_are_separate() -> None:
    a, b = ServerMetrics("node"), ServerMetrics("node")
    a.observe_request("/forward", 200)
    a.observe_request("/sessions/abc", 204)
    a.observe_request("/../../etc", 404)
    a.chunks.labels("processed").inc()
    a.bytes_in.labels("upstream").inc(10)
    a.stage_seconds.observe(0.01)
    a.codec_seconds.labels("decode").observe(0.001)
    families = {f.name: f for f in text_string_to_metric_families(a.render().decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in families["meshnet_requests"].samples
    }
    assert samples[("meshnet_requests_total", (("endpoint", "/forward"), ("status", "200")))] == 1
    assert samples[("meshnet_requests_total", (("endpoint", "/sessions"), ("status", "204")))] == 1
    assert samples[("meshnet_requests_total", (("endpoint", "other"), ("status", "404")))] == 1
    assert "meshnet_stage_seconds" in families
    assert b"meshnet_requests_total{" not in b.render()
    assert endpoint_label("/info") == "/info"


@pytest.mark.anyio
async def test_deadline_arithmetic() -> None:
    now = anyio.current_time()
    assert Deadline.start(now, 60.0, None).at == now + 60.0
    assert Deadline.start(now, 60.0, 2500).at == now + 2.5
    assert Deadline.start(now, 1.0, 2500).at == now + 1.0
    ahead = Deadline.after(10.0)
    assert 9000 < ahead.header_ms(margin=0.1) <= 9900
    assert Deadline.after(0.01).header_ms(margin=0.1) == 1  # never 0: 0 means spent
    spent = Deadline.start(now, 60.0, 0)
    with pytest.raises(DownstreamError) as exc:
        spent.check()
    assert (exc.value.status, exc.value.code) == (504, "deadline_exceeded")


def test_help_lists_the_choices_of_every_choice_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config("node", ["--help"], {})
    text = capsys.readouterr().out
    for shown in (
        "{echo,zeros,count}",
        "{auto,keep,float32,bfloat16,float16}",
        "{auto,numpy,torch}",
        "{mirror,identity,zstd,auto}",
        "{keep,float32,bfloat16,float16,auto-lossless}",
    ):
        assert shown in text


def test_one_source_for_every_default() -> None:
    """The config's defaults are the core's Limits and the loop's
    ServerSettings, its limits are built once, and /info shows both kinds."""
    config = load_config("node", [], {})
    limits, settings = Limits(), ServerSettings()
    assert config.limits == limits and config.limits is config.limits
    assert (config.timeout, config.head_timeout, config.max_connections) == (
        settings.body_timeout, settings.head_timeout, settings.max_connections)  # fmt: skip
    assert server_settings(config) == ServerSettings(write_timeout=config.timeout)
    info = config.limits_info()
    assert info["max_tensor_bytes"] == limits.max_tensor_bytes
    assert (info["head_timeout"], info["timeout"]) == (settings.head_timeout, config.timeout)
    assert not hasattr(limits, "head_timeout")  # the loop's, not the core's: the core never read it

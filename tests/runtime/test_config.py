"""Endpoints, configuration, metrics and deadlines of meshnet_runtime."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gateway.config import GATEWAY_FLAGS, GatewayConfig
from meshnet_node.config import NODE_FLAGS, NodeConfig
from meshnet_proto import DownstreamError, Limits
from meshnet_runtime import config as config_module
from meshnet_runtime.config import COMMON_FLAGS, ServerConfig, env_name
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.endpoints import format_url, parse_endpoint
from meshnet_runtime.http_server import ServerSettings
from meshnet_runtime.lifecycle import server_settings
from meshnet_runtime.metrics import ServerMetrics, Tally, TallyHistogram, endpoint_label


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
    config = GatewayConfig.load(["--timeout", "7"], env)
    assert config.timeout == 7.0  # flag beats env
    assert config.chunk_tokens == 64  # env beats default
    assert config.inflight == 1  # default
    assert config.entry is not None and config.entry.port == 1
    assert env_name("--chunk-tokens") == "MESHNET_CHUNK_TOKENS"


def test_config_node_flags() -> None:
    config = NodeConfig.load(
        ["--next", "unix:/tmp/n.sock", "--backend", "zeros", "--delay-ms", "2.5",
         "--wire-dtype", "auto-lossless", "--encoding", "zstd", "--zstd-level", "3"],
        {},
    )  # fmt: skip
    assert config.next is not None and config.next.scheme == "unix"
    assert (config.backend, config.delay_ms) == ("zeros", 2.5)
    assert (config.wire_dtype, config.encoding, config.zstd_level) == ("auto-lossless", "zstd", 3)
    assert config.limits.reorder_window == 16
    assert "s3cret" not in repr(NodeConfig.load(["--token", "s3cret"], {}))


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
        NodeConfig.load(argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_gateway_requires_entry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        GatewayConfig.load([], {})
    assert "--entry" in capsys.readouterr().err


def test_answers_are_counted_through_a_memo_of_known_paths_only() -> None:
    metrics = ServerMetrics("node")
    for _ in range(3):
        metrics.observe_request("/forward", 200)
    for n in range(50):  # a peer's made-up paths: counted, never remembered
        metrics.observe_request(f"/nope/{n}", 404)
    metrics.observe_request("/sessions/abc", 204)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {
        tuple(sorted(s.labels.items())): s.value for s in families["meshnet_requests"].samples
    }
    assert samples[(("endpoint", "/forward"), ("status", "200"))] == 3
    assert samples[(("endpoint", "other"), ("status", "404"))] == 50
    assert samples[(("endpoint", "/sessions"), ("status", "204"))] == 1
    assert set(metrics._answers) == {("/forward", 200)}


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


def test_a_tally_reads_as_a_counter_of_its_name_and_labels() -> None:
    """The hot counters are tallies (plain numbers, no lock per count): the
    same ``<name>_total`` series as a Counter, a label count refused by name."""
    metrics = ServerMetrics("node")
    tokens = Tally("meshnet_test_tokens", "Tokens", registry=metrics.registry)
    tokens.inc(3)
    tokens.inc()
    metrics.chunks.labels("processed").inc()
    metrics.chunks.labels("processed").inc(2)
    with pytest.raises(ValueError, match="takes labels"):
        metrics.chunks.labels("processed", "extra")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["meshnet_test_tokens"].type == "counter"
    assert [(s.name, s.labels, s.value) for s in families["meshnet_test_tokens"].samples] == [
        ("meshnet_test_tokens_total", {}, 4.0)
    ]
    assert [(s.name, s.labels, s.value) for s in families["meshnet_chunks"].samples] == [
        ("meshnet_chunks_total", {"outcome": "processed"}, 3.0)
    ]


def test_a_tally_histogram_reads_as_prometheus_own_histogram() -> None:
    """stage_seconds is kept as plain numbers: the same buckets (a value on a
    bound counts in it), count and sum as prometheus_client's Histogram."""
    bounds = (0.001, 0.01, 0.1, 1.0)
    ours = TallyHistogram("t", "T", bounds, registry=CollectorRegistry())
    theirs = Histogram("t", "T", buckets=bounds, registry=CollectorRegistry())
    for value in (0.0, 0.0005, 0.001, 0.002, 0.01, 0.5, 1.0, 3.0, 0.1):
        ours.observe(value)
        theirs.observe(value)

    def samples(collector: Any) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in collector.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        }

    assert samples(ours) == samples(theirs)
    assert samples(ours)[("t_bucket", "+Inf")] == 9 and samples(ours)[("t_bucket", "0.001")] == 3


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
        NodeConfig.load(["--help"], {})
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
    config = NodeConfig.load([], {})
    limits, settings = Limits(), ServerSettings()
    assert config.limits == limits and config.limits is config.limits
    assert (config.timeout, config.head_timeout, config.max_connections) == (
        settings.body_timeout, settings.head_timeout, settings.max_connections)  # fmt: skip
    assert server_settings(config) == ServerSettings(write_timeout=config.timeout)
    info = config.limits_info()
    assert info["max_tensor_bytes"] == limits.max_tensor_bytes
    assert (info["head_timeout"], info["timeout"]) == (settings.head_timeout, config.timeout)
    assert not hasattr(limits, "head_timeout")  # the loop's, not the core's: the core never read it


# -- the roles' flags beside their servers, the common ones in the runtime -------------


def _options(config: type[ServerConfig]) -> set[str]:
    """The long options ``meshnet-<role> --help`` lists."""
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", config.build_parser().format_help()))


def test_each_role_parses_the_common_flags_and_only_its_own() -> None:
    common = {flag.name for flag in COMMON_FLAGS}
    node_only = {flag.name for flag in NODE_FLAGS} - {flag.name for flag in GATEWAY_FLAGS}
    gateway_only = {flag.name for flag in GATEWAY_FLAGS} - {flag.name for flag in NODE_FLAGS}
    assert {"--next", "--backend", "--engine", "--kv-budget-bytes"} <= node_only
    assert {"--entry", "--retries", "--special-tokens-in-content", "--max-running"} <= gateway_only
    assert _options(NodeConfig) == common | {flag.name for flag in NODE_FLAGS} | {"--help"}
    assert _options(GatewayConfig) == common | {flag.name for flag in GATEWAY_FLAGS} | {"--help"}
    assert _options(ServerConfig) == common | {"--help"}
    assert not hasattr(NodeConfig.load([], {}), "retries")
    assert not hasattr(GatewayConfig.load(["--entry", "http://a:1"], {}), "engine")


@pytest.mark.parametrize(
    ("config", "argv"),
    [
        (NodeConfig, ["--entry", "http://a:1"]),
        (NodeConfig, ["--retries", "3"]),
        (NodeConfig, ["--special-tokens-in-content", "keep"]),
        (GatewayConfig, ["--entry", "http://a:1", "--next", "http://b:2"]),
        (GatewayConfig, ["--entry", "http://a:1", "--engine", "torch"]),
        (GatewayConfig, ["--entry", "http://a:1", "--kv-budget-bytes", "1GiB"]),
    ],
)
def test_a_role_refuses_the_other_roles_flags(
    config: type[ServerConfig], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        config.load(argv, {})
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_a_role_reads_no_variable_of_the_other_roles_flags() -> None:
    node_only = {f.name for f in NODE_FLAGS} - {f.name for f in GATEWAY_FLAGS}
    gateway_only = {f.name for f in GATEWAY_FLAGS} - {f.name for f in NODE_FLAGS}
    # "" is no valid value of any of them: read, it would exit 2 naming the variable.
    assert GatewayConfig.load(["--entry", "http://a:1"], {env_name(f): "" for f in node_only})
    assert NodeConfig.load([], {env_name(f): "" for f in gateway_only})


@pytest.mark.parametrize("config", [ServerConfig, NodeConfig, GatewayConfig])
def test_one_table_names_every_field(config: type[ServerConfig]) -> None:
    """Each flag is a field with a default, and each field a flag (but what the
    config derives: the core's limits, a hop's replica set)."""
    derived = {"limits", "next_replicas", "entry_replicas"}
    assert {flag.dest for flag in config.flags()} == {f.name for f in fields(config)} - derived
    assert set(config.defaults()) >= {flag.dest for flag in config.flags()}
    assert len({flag.name for flag in config.flags()}) == len(config.flags())  # no flag twice


def test_the_runtime_config_imports_no_role() -> None:
    """The runtime's config knows no role: neither its source nor its import
    loads meshnet_node or meshnet_gateway."""
    source = Path(config_module.__file__ or "").read_text()
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m.split(".")[0] in ("meshnet_node", "meshnet_gateway")}
    probe = (
        "import sys, meshnet_runtime.config, meshnet_runtime.lifecycle; print(sorted(sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert "meshnet_node" not in loaded and "meshnet_gateway" not in loaded

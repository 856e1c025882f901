"""``meshnet bench --only serve`` in its smallest mode (a toy GGUF written by the
section), and its client's parsing and error counting. No timing is asserted."""

from __future__ import annotations

import anyio
import pytest

from meshnet_bench import serve
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, render


def test_serve_section_tiny_reports_every_level_and_the_mid_stream_round() -> None:
    lines: list[str] = []
    result = serve.run(BenchOptions(tiny=True, progress=lines.append))
    keys = result.keys
    assert "serve" in SECTIONS
    for n in (1, 4):
        assert keys[f"serve_tokens_{n}"] > 0
        assert keys[f"serve_tok_s_{n}"] > 0
        assert keys[f"serve_scaling_{n}"] > 0
        assert keys[f"serve_gap_p50_over_1_{n}"] > 0
        assert keys[f"serve_ttft_p50_ms_{n}"] <= keys[f"serve_ttft_p99_ms_{n}"]
        assert keys[f"serve_gap_p50_ms_{n}"] <= keys[f"serve_gap_p99_ms_{n}"]
        assert keys[f"serve_errors_{n}"] == 0 and keys[f"serve_cut_{n}"] == 0
        # Today's nodes have no busy counter: the stage-time histogram stands in.
        assert keys[f"serve_util_stage1_{n}"] > 0 and keys[f"serve_util_stage2_{n}"] > 0
        assert keys[f"serve_cpu_gateway_{n}"] is not None
    assert keys["serve_scaling_1"] == 1.0
    assert keys["serve_busy_metric"] in serve.BUSY_METRICS
    assert keys["serve_errors"] == "0"
    assert keys["serve_mid_long_status_4"] == "200"
    assert keys["serve_mid_long_s_4"] > 0
    assert keys["serve_long_prompt_tokens"] == 256
    assert not any(k.endswith(("_16", "_64")) for k in keys)  # not measured in tiny mode
    assert set(keys) <= set(serve.KEYS)
    assert [row["streams"] for row in result.rows] == ["1", "4", "4 + long"]
    text = render([result], keys, "header")
    assert "gap p99 vs plain" in text and "serve_tok_s_4" in text
    assert any("4 stream(s)" in line for line in lines)


def test_events_are_parsed_as_they_arrive() -> None:
    stream = serve._Stream()
    stream.feed(b'data: {"choices": [{"text": "1"}]}\n\n: still generating\n\ndata: {"ch', 1.0)
    stream.feed(b'oices": [{"text": ""}]}\n\ndata: {"choices": [{"text": ","}]}\n\n', 2.0)
    stream.feed(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n', 3.0)
    assert stream.times == [1.0, 2.0] and stream.tokens == 2  # not done: the events count
    stream.feed(b"data: [DONE]\n\n", 4.0)
    assert stream.done and stream.tokens == 3  # done: the usage counts
    failed = serve._Stream()
    failed.feed(b'data: {"error": {"code": "downstream_timeout"}}\n\n', 1.0)
    assert failed.error == "stream:downstream_timeout"


@pytest.mark.anyio
async def test_a_refused_request_is_counted_by_its_status_not_raised() -> None:
    async def refuse(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.receive()
            await client.send(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n"
                              b"connection: close\r\n\r\nbusy")  # fmt: skip

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, refuse)
        refused = serve._Stream()
        await serve._post_stream(f"http://127.0.0.1:{port}", {"prompt": "x"}, refused)
        group.cancel_scope.cancel()
    await listener.aclose()  # nobody listens on the port now
    assert refused.error == "503" and refused.tokens == 0
    nobody = serve._Stream()
    await serve._post_stream(f"http://127.0.0.1:{port}", {"prompt": "x"}, nobody)
    assert nobody.error is not None and nobody.error.startswith("conn:")

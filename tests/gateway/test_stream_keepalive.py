"""A streamed answer stays audible while nothing else is written (a long
prefill): an SSE comment every KEEPALIVE_SECONDS of quiet, on trio's
virtual clock; and its chunks carry no null field a client must skip."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import trio
import trio.testing

from meshnet_gateway.openai.formats import ChatFormat
from meshnet_gateway.openai.output import GenerationResult
from meshnet_gateway.openai.streamed import (
    KEEPALIVE_SECONDS,
    SSE_HEARTBEAT,
    OpenStreams,
    stream_events,
)
from meshnet_gateway.openai.tool_syntax import HERMES

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def _run(pieces: list[tuple[float, str]], finish: str = "stop") -> Callable[..., Any]:
    """A generation that writes each piece after its (virtual) delay."""

    async def run(on_text: Callable[[int], Any]) -> list[GenerationResult]:
        text = on_text(0)
        for delay, piece in pieces:
            await trio.sleep(delay)  # stall under test: a prefill this long, on the virtual clock
            await text(piece, None)
        return [
            GenerationResult(
                prompt_tokens=3,
                completion_tokens=len(pieces),
                finish_reason=finish,
                text="".join(p for _, p in pieces),
            )
        ]

    return run


def _stream(fmt: ChatFormat, run: Callable[..., Any]) -> list[tuple[float, bytes]]:
    written: list[tuple[float, bytes]] = []

    async def send(data: bytes) -> None:
        written.append((trio.current_time(), data))

    async def main() -> None:
        await stream_events(send, fmt, 1, True, run, OpenStreams())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return written


def test_a_quiet_stream_gets_a_comment_every_interval_and_no_more() -> None:
    # 40 s of prefill before the first piece, then pieces closer than the interval.
    run = _run([(2.5 * KEEPALIVE_SECONDS, "Hello"), (1.0, " world")])
    written = _stream(ChatFormat("m"), run)
    beats = [at for at, data in written if data == SSE_HEARTBEAT]
    start = written[0][0]
    assert [round(at - start, 6) for at in beats] == [KEEPALIVE_SECONDS, 2 * KEEPALIVE_SECONDS]
    events = [data for _, data in written if data != SSE_HEARTBEAT]
    assert events[-1] == b"data: [DONE]\n\n"
    text = "".join(
        choice["delta"].get("content", "")
        for data in events[:-1]
        for choice in json.loads(data.removeprefix(b"data: "))["choices"]
    )
    assert text == "Hello world"


def test_a_stream_that_writes_needs_no_comment() -> None:
    run = _run([(KEEPALIVE_SECONDS * 0.9, "a")] * 4)
    assert all(data != SSE_HEARTBEAT for _, data in _stream(ChatFormat("m"), run))


def test_tool_call_chunks_carry_no_null_delta_field() -> None:
    fmt = ChatFormat("m", HERMES, ("f",))
    written = _stream(fmt, _run([(0.1, "<tool_"), (0.1, CALL[6:])]))
    chunks = [json.loads(d.removeprefix(b"data: ")) for _, d in written if d.startswith(b"data: {")]
    deltas = [c["delta"] for chunk in chunks for c in chunk["choices"]]
    assert all(value is not None for delta in deltas for value in delta.values())
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    assert finish[-1] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == 2

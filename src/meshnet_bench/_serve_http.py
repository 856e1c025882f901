"""The serve section's HTTP client: one request per connection, a stream's
server-sent events timed as they arrive, and what each process reports
(``GET /metrics`` busy seconds, ``/proc`` CPU seconds).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import h11

__all__ = ["BUSY_METRICS", "Stream", "busy", "cpu_seconds", "http", "model_id", "post_stream"]

# The metric each node exports for the seconds its stage spent computing;
# until it exists, the stage-time histogram's sum says nearly the same.
BUSY_METRICS = ("meshnet_stage_busy_seconds_total", "meshnet_stage_seconds_sum")


@dataclass(slots=True)
class Stream:
    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each text event
    usage_tokens: int | None = None  # the usage event's completion_tokens
    done: bool = False  # [DONE] seen
    error: str | None = None  # status, error event code or exception
    _buffer: bytes = b""

    def feed(self, data: bytes, now: float) -> None:
        """Server-sent events (``data: {...}`` blocks ended by a blank line);
        a text event's time is the arrival of the bytes that ended it."""
        self._buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                continue  # a heartbeat comment
            payload = b"\n".join(lines)
            if payload == b"[DONE]":
                self.done = True
                continue
            document = json.loads(payload)
            if "error" in document:
                self.error = f"stream:{document['error'].get('code')}"
                continue
            usage = document.get("usage")
            if usage:
                self.usage_tokens = int(usage["completion_tokens"])
            if any(choice.get("text") for choice in document.get("choices") or ()):
                self.times.append(now)

    @property
    def tokens(self) -> int:
        # A stream that finished says how many tokens it generated; one cut
        # at the cap counts the text events it got (a token whose text is
        # held back, say half a UTF-8 character, sends no event).
        if self.done and self.usage_tokens is not None:
            return self.usage_tokens
        return len(self.times)


async def http(
    url: str, method: str, target: str, body: bytes = b"", stream: Stream | None = None
) -> tuple[int, bytes]:
    """One request on its own connection (``Connection: close``): the status
    and the body; a 200 body goes to ``stream.feed`` as it arrives instead."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", f"{host}:{port}"), ("connection", "close")]
    if body:
        headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
    status, chunks = 0, []
    async with await anyio.connect_tcp(host, port) as sock:
        await sock.send(conn.send(h11.Request(method=method, target=target, headers=headers)))
        if body:
            await sock.send(conn.send(h11.Data(data=body)))
        await sock.send(conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await sock.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    data = b""
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if stream is not None and status == 200:
                    stream.feed(bytes(event.data), time.perf_counter())
                else:
                    chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(chunks)


async def post_stream(url: str, payload: dict[str, Any], stream: Stream) -> None:
    """One streaming completion into ``stream``; never raises but cancellation."""
    stream.sent = time.perf_counter()
    try:
        status, _ = await http(url, "POST", "/v1/completions", json.dumps(payload).encode(), stream)
    except Exception as exc:  # the bench counts it and goes on
        stream.error = f"conn:{type(exc).__name__}"
        return
    if status != 200:
        stream.error = str(status)
    elif not stream.done and stream.error is None:
        stream.error = "stream:no [DONE]"


async def model_id(url: str) -> str:
    status, body = await http(url, "GET", "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
    return str(json.loads(body)["data"][0]["id"])


async def busy(urls: Sequence[str]) -> tuple[list[float | None], str | None]:
    """Each node's busy seconds so far, and the metric read (module doc)."""
    texts = []
    for url in urls:
        status, body = await http(url, "GET", "/metrics")
        texts.append(body.decode() if status == 200 else "")
    for name in BUSY_METRICS:
        values: list[float | None] = []
        for text in texts:
            found = [
                line.split()[-1]
                for line in text.splitlines()
                if line.startswith(name + " ") or line.startswith(name + "{")
            ]
            values.append(sum(map(float, found)) if found else None)
        if any(v is not None for v in values):
            return values, name
    return [None] * len(urls), None


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU seconds (``/proc/<pid>/stat``; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

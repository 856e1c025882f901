"""A scripted one-node chain that verifies windows (wire-2 §3.16), over loopback.

``FakeVerifier`` holds each session's tokens, routes a chunk that carries
``X-Meshnet-After`` as §3.16 says (a successor once the session holds ``F``
tokens in its line; a rewind after every stale window, dropping what they
left; an older line: 409 ``window_stale``) and answers as a last stage
does, with the node's own functions (``meshnet_node.draw``): logits, a drawn
token, or a verified window. Its "model" (``ScriptModel``) is a function of
the tokens held: noise plus a strong preference for a repeated pattern, so
prompt lookup drafts well and a deviation makes a window fail.

Knobs for the gateway's tests: ``windows_as_logits`` (a last stage without
§3.16: a window is run as a plain chunk and answered its logits),
``refuse`` (a chunk answered an error of the given code: 400 for a
``bad_…`` one, else 409), ``hold_window`` (the
session's window of that number, from 1, is answered only once the next
window has arrived: proof that the gateway keeps windows in flight).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc
import numpy as np

from meshnet_gateway.openai.generation import ChainSettings
from meshnet_gateway.openai.prefix_index import PrefixIndex
from meshnet_gateway.openai.speculation import Speculate
from meshnet_node.draw import draw_answer, verify_answer
from meshnet_node.windows import window_accepted
from meshnet_proto import WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import AfterSpec
from support.serving import scripted_peer

__all__ = ["FakeVerifier", "ScriptModel", "fake_verifier"]

WAIT = 10.0  # seconds a chunk waits for its predecessors (a node's reorder timeout)


class ScriptModel:
    """Logits after a sequence: noise, and ``boost`` on the pattern's token
    for the next position (``deviations`` override it at some positions)."""

    def __init__(
        self,
        pattern: Sequence[int],
        vocab: int,
        deviations: dict[int, int] | None = None,
        boost: float = 6.0,
    ) -> None:
        self.pattern = list(pattern)
        self.vocab = vocab
        self.deviations = deviations or {}
        self.boost = boost

    def target(self, position: int) -> int:
        return self.deviations.get(position, self.pattern[position % len(self.pattern)])

    def row(self, held: Sequence[int]) -> np.ndarray:
        """The logits deciding the token at ``len(held)``."""
        rng = np.random.default_rng([len(held), held[-1]])
        row = rng.standard_normal(self.vocab).astype(np.float32)
        row[self.target(len(held))] += self.boost
        return row


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)
    epoch: int = 0
    windows: int = 0  # windows received
    next_window: anyio.Event = field(default_factory=anyio.Event)  # the held one's successor


class FakeVerifier:
    def __init__(
        self,
        model: ScriptModel,
        *,
        windows_as_logits: bool = False,
        refuse: Callable[[WireHeaders], str | None] | None = None,
        hold_window: int = 0,
    ) -> None:
        self.model = model
        self.windows_as_logits = windows_as_logits
        self.refuse = refuse
        self.hold_window = hold_window  # 1-based; 0: none held
        self.sessions: dict[str, _Session] = {}
        self.changed = anyio.Condition()
        self.seen: list[WireHeaders] = []  # every chunk's head, as it arrived
        self.deleted: list[str] = []

    @property
    def windows(self) -> list[WireHeaders]:
        return [h for h in self.seen if h.draft is not None]

    async def forward(self, headers: WireHeaders, ids: np.ndarray) -> tuple[int, object]:
        """(200, answer tensor) or (4xx, error code)."""
        self.seen.append(headers)
        session = self.sessions.setdefault(headers.session or "", _Session())
        window = headers.draft is not None and not self.windows_as_logits
        held_back = False
        if window:
            session.windows += 1
            held_back = session.windows == self.hold_window
            if session.windows == self.hold_window + 1:
                session.next_window.set()
        code = self.refuse(headers) if self.refuse is not None else None
        if code is not None:
            return 409, code
        after = headers.after if window or headers.draft is None else None
        p = headers.position or 0
        async with self.changed:
            code = await self._wait(session, p, after)
            if code is not None:
                return 409, code
            del session.tokens[p:]
            session.tokens.extend(int(i) for i in ids.reshape(-1))
            held = list(session.tokens)
            self.changed.notify_all()
        if held_back:
            with anyio.fail_after(WAIT):
                await session.next_window.wait()
        return 200, self._answer(headers, held, p, ids.size, window)

    def accepted(self, headers: WireHeaders, answer: np.ndarray) -> int | None:
        """The answer's ``X-Meshnet-Accepted``: a verified window's ``n - 1`` (§3.16)."""
        if self.windows_as_logits:
            return None
        return window_accepted(headers, answer.shape, answer.dtype.name)

    async def _wait(self, session: _Session, p: int, after: AfterSpec | None) -> str | None:
        """None once the chunk may run (wire-2 §3.16's routing), else the 409's code."""
        if after is None:
            return None if p == len(session.tokens) else "position_mismatch"
        position, epoch = after.position, after.epoch
        with anyio.move_on_after(WAIT):
            while True:
                if epoch < session.epoch:
                    return "window_stale"
                line = epoch - 1 if p < position else epoch
                if len(session.tokens) == position and session.epoch == line:
                    session.epoch = epoch
                    return None
                await self.changed.wait()
        return "chunk_wait_timeout"

    def _answer(
        self, headers: WireHeaders, held: list[int], p: int, count: int, window: bool
    ) -> np.ndarray:
        rows = np.stack([self.model.row(held[: p + i + 1]) for i in range(count)])
        spec = headers.sample
        if spec is None or (headers.draft is not None and not window):
            return rows[-1:]  # logits: no draw asked, or a window not understood
        if window:
            assert headers.draft is not None
            return verify_answer(rows[None], spec, headers.draft, p)
        return draw_answer(rows[-1:], spec, p + count)


async def _read_request(
    stream: anyio.abc.SocketStream, buffer: bytes
) -> tuple[bytes, bytes, bytes, bytes]:
    """(request line, header lines, body, what follows) of the next request."""
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive(65536)
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(
        dict((k.lower(), v) for k, v in _pairs(b"\r\n".join(lines[1:]))).get(b"content-length", 0)
    )
    while len(buffer) < length:
        buffer += await stream.receive(65536)
    return lines[0], b"\r\n".join(lines[1:]), buffer[:length], buffer[length:]


def _pairs(raw: bytes) -> list[tuple[bytes, bytes]]:
    pairs = []
    for line in raw.split(b"\r\n"):
        name, _, value = line.partition(b":")
        pairs.append((name.strip(), value.strip()))
    return pairs


def _reply(status: int, pairs: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    fields = b"".join(k + b": " + v + b"\r\n" for k, v in pairs)
    return b"HTTP/1.1 %d X\r\n" % status + fields + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _error(code: str) -> bytes:
    status = 400 if code.startswith("bad_") else 409
    error = {"status": status, "code": code, "message": code, "header": None, "hop": None}
    body = json.dumps({"error": error}).encode()
    return _reply(status, [(b"Content-Type", b"application/json")], body)


@asynccontextmanager
async def fake_verifier(fake: FakeVerifier) -> AsyncIterator[str]:
    """``fake`` served on a loopback port; its URL."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        closed = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)
        async with stream:
            buffer = b""
            with contextlib.suppress(*closed):
                while True:
                    start, raw, body, buffer = await _read_request(stream, buffer)
                    if start.startswith(b"DELETE /sessions/"):
                        fake.deleted.append(start.split(b" ")[1].decode().rsplit("/", 1)[1])
                        await stream.send(b"HTTP/1.1 204 No Content\r\n\r\n")
                        continue
                    headers = parse_wire_headers(_pairs(raw))
                    ids = np.frombuffer(body, dtype="<i4").reshape(headers.shape)
                    status, answer = await fake.forward(headers, ids)
                    if status != 200:
                        await stream.send(_error(str(answer)))
                        continue
                    assert isinstance(answer, np.ndarray)
                    out = WireHeaders(
                        shape=answer.shape,
                        dtype="int32" if answer.dtype.kind == "i" else "float32",
                        session=headers.session,
                        chunk_index=headers.chunk_index,
                        chunk_total=headers.chunk_total,
                        position=headers.position,
                        accepted=fake.accepted(headers, answer),
                    )
                    await stream.send(_reply(200, out.to_pairs(), answer.tobytes()))

    async with scripted_peer(handle) as url:
        yield url


def scripted_settings(
    speculate: Speculate | None, prefix: PrefixIndex | None = None
) -> ChainSettings:
    """A generation's settings over a ``fake_verifier`` chain: identity
    bodies, one chunk in flight, ``speculate`` as given."""
    return ChainSettings(
        chunk_tokens=64,
        inflight=1,
        encoding="identity",
        zstd_level=1,
        timeout=10.0,
        speculate=speculate,
        prefix=prefix,
    )

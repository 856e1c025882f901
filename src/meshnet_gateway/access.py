"""The gateway's access log: one line per request, at info, on ``meshnet.access``.

What an operator of uvicorn, vLLM or llama.cpp's server reads first: who
asked what, how it ended, how long it took — and for a generation its
tokens and speed::

    127.0.0.1 "POST /v1/completions" 200 prompt_tokens=5 completion_tokens=8 \\
        ttft=0.041s tok/s=52.3 drafted=12 accepted=9 duration=0.186s    (one line)
    127.0.0.1 "GET /health" 200 duration=0.000s
    127.0.0.1 "POST /v1/chat/completions" 200 tenant=acme prompt_tokens=…  (with --api-keys)

``ttft``: arrival to the first token sampled (queue and prefill included);
``tok/s``: the decode rate, tokens after the first per second after the
first (``-`` under two tokens); ``drafted``/``accepted``: tokens drafted in
its verify windows and those the last stage accepted (speculative decoding,
0 without), ``drafter``: ``lookup`` or ``model`` (``--draft-model``; absent
with ``--speculate off``); ``duration``: arrival to the last byte
handed to the connection (a stream: its end). A request whose client left
before its answer is logged with status 499 (nginx's "client closed
request"), a stream whose client left with ``client_left``. Written where
the gateway answers (``GatewayApp``): what the wire-2 core refuses before
routing (a bad head, an unknown path, a missing token) is counted in
``meshnet_requests_total`` but has no line — its method and path are not
known there. ``--no-access-log`` turns it off.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio

from meshnet_proto import MeshnetError
from meshnet_runtime.application import Reply, RequestContext, StreamReply

from .openai.timing import RequestTiming

__all__ = ["CLIENT_CLOSED", "AccessLog", "AccessRecord", "access_record", "status_of"]

R = TypeVar("R")

log = logging.getLogger("meshnet.access")

# nginx's status for a request whose client closed the connection first.
CLIENT_CLOSED = 499


@dataclass(slots=True)
class AccessRecord:
    method: str
    path: str
    peer: str | None
    started: float  # RequestContext.started: the anyio clock
    timing: RequestTiming | None = None  # a /v1 generation's, filled in as it goes
    tenant: str | None = None  # the API key's (docs/security.md): who to bill, who to ask


class AccessLog:
    """Writes the lines; disabled, it writes none (and costs one test)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def write(self, record: AccessRecord, status: int, *, client_left: bool = False) -> None:
        if not self.enabled or not log.isEnabledFor(logging.INFO):
            return
        log.info("%s", line(record, status, anyio.current_time(), client_left=client_left))

    async def around(
        self, record: AccessRecord, call: Callable[[], Awaitable[R]], *, answered: bool = True
    ) -> R:
        """``await call()``, its line written as it ends: a failure's status
        at once; a success's when ``answered`` (a head check that passes is
        not the answer yet) — a stream's once it has ended (its tokens are
        known then), a ``Reply``'s status, otherwise (an activation) 200."""
        try:
            reply = await call()
        except BaseException as exc:
            self.write(record, status_of(exc))
            raise
        if not answered:
            return reply
        if isinstance(reply, StreamReply):
            return cast(R, _logged_stream(reply, self, record))
        self.write(record, reply.status if isinstance(reply, Reply) else 200)
        return reply


def line(record: AccessRecord, status: int, now: float, *, client_left: bool = False) -> str:
    """The access line of ``record`` answered ``status``, ending at ``now``."""
    parts = [record.peer or "-", f'"{record.method} {record.path}"', str(status)]
    if record.tenant is not None:
        parts.append(f"tenant={record.tenant}")
    timing = record.timing
    if timing is not None and timing.prompt_tokens is not None:
        ttft = timing.ttft
        rate = timing.decode_rate
        parts += [
            f"prompt_tokens={timing.prompt_tokens}",
            f"completion_tokens={timing.completion_tokens}",
            f"ttft={'-' if ttft is None else f'{ttft:.3f}s'}",
            f"tok/s={'-' if rate is None else f'{rate:.1f}'}",
            f"drafted={timing.drafted}",
            f"accepted={timing.accepted}",
        ]
        if timing.drafter is not None:
            parts.append(f"drafter={timing.drafter}")
    parts.append(f"duration={max(now - record.started, 0.0):.3f}s")
    if client_left:
        parts.append("client_left")
    return " ".join(parts)


def access_record(method: str, path: str, query: str, ctx: RequestContext) -> AccessRecord:
    # A target is bounded by the core's head limit; a log line by less.
    target = f"{path}?{query}" if query else path
    return AccessRecord(method, target[:200], ctx.peer, ctx.started, tenant=ctx.tenant)


def status_of(exc: BaseException) -> int:
    """The status a failed handler's request is answered (or logged) with."""
    if isinstance(exc, MeshnetError):
        return exc.status
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return CLIENT_CLOSED  # the client left (or the server stops): no answer
    return 500  # the serving loop answers internal_error


def _logged_stream(reply: StreamReply, access: AccessLog, record: AccessRecord) -> StreamReply:
    """``reply`` whose line is written when its stream ends, whether it ended
    whole, failed, or its client left."""

    async def produce(send: Any) -> None:
        client_left = True  # unless produce returns or raises: cancelled
        try:
            await reply.produce(send)
            client_left = False
        except Exception:
            client_left = False
            raise
        finally:
            access.write(record, reply.status, client_left=client_left)

    return StreamReply(reply.status, reply.headers, produce, heartbeat=reply.heartbeat)

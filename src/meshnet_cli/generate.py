"""``meshnet generate``: stream a completion from a running gateway's OpenAI API.

Plain ``http.client`` (the CLI is synchronous, and the OpenAI API is
ordinary HTTP): POST ``/v1/completions`` (or ``/v1/chat/completions`` with
``--chat``) with ``stream: true`` and print each text piece as its event
arrives; a summary (finish reason, token counts, time to the first text
and the decode rate, as the client saw them) goes to stderr.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO
from urllib.parse import urlsplit

__all__ = ["GenerateError", "run_generate", "stream_events"]


class GenerateError(Exception):
    """The gateway refused or failed the request (its message, as it said it)."""


def _connection(url: str, timeout: float, tls_ca: str | None) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GenerateError(f"not an http(s) URL: {url!r}")
    if parts.scheme == "https":
        context = ssl.create_default_context(cafile=tls_ca)
        return http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout, context=context
        )
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _headers(token: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return f"{status} {error.get('code') or error.get('type')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{status}: {body[:200].decode('utf-8', 'replace')}"


def _code(body: bytes) -> object:
    try:
        return json.loads(body)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _refused(path: str, status: int, body: bytes) -> GenerateError:
    if status == 404 and _code(body) == "not_found":
        # A gateway started without --model has no /v1 routes at all (the
        # core's "no such path"), which a bare 404 would not explain. An
        # unknown model is a 404 too, but with OpenAI's model_not_found.
        return GenerateError(
            f"404 on {path}: this gateway serves no OpenAI API; start it with "
            "--model DIR (or run `meshnet run --model DIR`)"
        )
    return GenerateError(_error_message(status, body))


def first_model(conn: http.client.HTTPConnection, token: str | None) -> str:
    conn.request("GET", "/v1/models", headers=_headers(token))
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise _refused("/v1/models", response.status, body)
    data = json.loads(body).get("data") or []
    if not data:
        raise GenerateError("the gateway serves no model (start it with --model DIR)")
    return str(data[0]["id"])


def stream_events(
    conn: http.client.HTTPConnection, path: str, payload: dict[str, Any], token: str | None
) -> Iterator[dict[str, Any]]:
    """POST ``payload`` and yield each server-sent event's JSON until ``[DONE]``."""
    conn.request("POST", path, body=json.dumps(payload).encode(), headers=_headers(token))
    response = conn.getresponse()
    if response.status != 200:
        raise _refused(path, response.status, response.read())
    data: list[str] = []
    while True:
        line = response.readline()
        if not line:
            raise GenerateError("the gateway closed the stream before [DONE]")
        text = line.decode("utf-8").rstrip("\r\n")
        if text.startswith("data:"):
            data.append(text[5:].removeprefix(" "))
            continue
        if text or not data:
            continue  # comments, other fields, stray blank lines
        event, data = "\n".join(data), []
        if event == "[DONE]":
            return
        document = json.loads(event)
        if "error" in document:
            raise GenerateError(_error_message(502, event.encode()))
        yield document


def run_generate(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    payload: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.top_k is not None:
        payload["top_k"] = args.top_k
    if args.seed is not None:
        payload["seed"] = args.seed
    if args.stop:
        payload["stop"] = args.stop
    if args.chat:
        path = "/v1/chat/completions"
        payload["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        path = "/v1/completions"
        payload["prompt"] = args.prompt
    finish, usage = None, None
    first: float | None = None  # when the first text arrived
    last: float | None = None  # when the last text (or the finish) arrived
    try:
        conn = _connection(args.gateway, args.timeout, args.tls_ca)
        try:
            payload["model"] = args.model or first_model(conn, args.token)
            sent = time.monotonic()
            for event in stream_events(conn, path, payload, args.token):
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = choice["delta"].get("content") if args.chat else choice.get("text")
                    if piece:
                        last = time.monotonic()
                        first = last if first is None else first
                        out.write(piece)
                        out.flush()
                    if choice.get("finish_reason"):
                        last = time.monotonic()
                    finish = choice.get("finish_reason") or finish
        finally:
            conn.close()
    except GenerateError as exc:
        print(f"meshnet generate: {args.gateway}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
        print(f"meshnet generate: {args.gateway}: {exc}", file=sys.stderr)
        return 1
    out.write("\n")
    out.flush()
    counts = ""
    if usage:
        counts = (
            f", {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens"
        )
    print(f"[finish_reason {finish}{counts}{_speed(sent, first, last, usage)}]", file=sys.stderr)
    return 0


def _speed(
    sent: float, first: float | None, last: float | None, usage: dict[str, Any] | None
) -> str:
    """``, TTFT 0.041 s, 52.3 tok/s``: the time from sending the request to
    the first text, and the decode rate — completion tokens after the first
    per second after the first text (the gateway's access line computes the
    same on its side); a part that cannot be known (no text, one token) is left out."""
    parts = []
    if first is not None:
        parts.append(f"TTFT {first - sent:.3f} s")
    tokens = int(usage["completion_tokens"]) if usage else 0
    if first is not None and last is not None and last > first and tokens >= 2:
        parts.append(f"{(tokens - 1) / (last - first):.1f} tok/s")
    return "".join(f", {part}" for part in parts)

"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from meshnet_proto import MeshnetError
from meshnet_runtime.http_server import Reply

__all__ = ["OpenAIError", "from_meshnet", "invalid"]


class OpenAIError(Exception):
    """A request the OpenAI surface refuses (4xx) or could not serve (5xx)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def reply(self) -> Reply:
        reply = Reply.json(self.status, self.body())
        if self.retry_after is None:
            return reply
        # A node out of KV memory says when to come back: the client hears it.
        headers = [*reply.headers, (b"retry-after", str(self.retry_after).encode())]
        return Reply(reply.status, headers, reply.body)


def invalid(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, param=param, code=code)


def from_meshnet(exc: MeshnetError) -> OpenAIError:
    """A chain failure (a node's error, unreachable, timed out) in OpenAI's shape."""
    hop = f" (hop {exc.hop})" if exc.hop else ""
    kind = "server_error" if exc.status >= 500 else "invalid_request_error"
    retry = int(exc.retry_after) if exc.retry_after is not None else None
    return OpenAIError(
        f"{exc.message}{hop}", status=exc.status, type=kind, code=exc.code, retry_after=retry
    )

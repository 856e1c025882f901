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
    ) -> None:
        super().__init__(message)
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
        return Reply.json(self.status, self.body())


def invalid(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, param=param, code=code)


def from_meshnet(exc: MeshnetError) -> OpenAIError:
    """A chain failure (a node's error, unreachable, timed out) in OpenAI's shape."""
    hop = f" (hop {exc.hop})" if exc.hop else ""
    kind = "server_error" if exc.status >= 500 else "invalid_request_error"
    return OpenAIError(f"{exc.message}{hop}", status=exc.status, type=kind, code=exc.code)

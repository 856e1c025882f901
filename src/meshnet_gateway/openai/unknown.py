"""A /v1 path the gateway does not serve, answered as OpenAI answers one.

The wire-2 core answers an unknown path with its own 404 body (wire-2 §4),
which an OpenAI client cannot read: it looks for ``{"error": {"message",
"type", "param", "code"}}``. So the OpenAI surface routes every other path
under /v1 (``/v1/embeddings``, ``/v1/audio/speech``, …) to itself and
refuses it in that shape, naming the path.
"""

from __future__ import annotations

from .errors import OpenAIError

__all__ = ["UNKNOWN_METHODS", "UNKNOWN_ROUTE", "unknown_path"]

# Last in the route table: the served /v1 paths match before it.
UNKNOWN_ROUTE = "/v1/**"
UNKNOWN_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# An HTTP path is printable ASCII (h11 checks it); a long one is cut.
_SHOWN_PATH = 200


def unknown_path(method: str, path: str) -> OpenAIError:
    return OpenAIError(
        f"Invalid URL ({method} {path[:_SHOWN_PATH]}): this gateway serves /v1/models, "
        "/v1/completions and /v1/chat/completions",
        status=404,
        code="unknown_url",
    )

"""What a case is, what it runs against, and the expectations cases share.

A case is an id, the spec section it checks, one line saying what the spec
requires, and a function that sends requests and raises ``CheckFailed`` when
the answer is not the one required. Most cases are one request and one
expected answer (``single``); sequencing cases are a few requests in order.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._wire import CheckFailed, Connection, Response, Target, build_request

__all__ = [
    "Case",
    "Context",
    "expect_error",
    "expect_tensor",
    "float32_body",
    "single",
]

Roles = frozenset[str]
BOTH: Roles = frozenset({"node", "gateway"})
NODE: Roles = frozenset({"node"})
GATEWAY: Roles = frozenset({"gateway"})

# Every case's tensor: [1, tokens, 4] float32, small and finite, so any stage
# that takes float activations of hidden size 4 (the echo stage) serves it.
HIDDEN = 4


@dataclass(slots=True)
class Context:
    """The server under test, and what the checker learned about it."""

    target: Target
    token: str | None = None
    role: str = "node"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def reorder_window(self) -> int:
        window = self.info.get("reorder_window", 16)
        return window if isinstance(window, int) and window > 0 else 16

    def connect(self) -> Connection:
        return self.target.connect()

    def request(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        auth: bool = True,
        **options: Any,
    ) -> bytes:
        return build_request(
            method,
            path,
            self.target,
            headers,
            body,
            token=self.token if auth else None,
            **options,
        )

    def send(self, request: bytes) -> Response:
        with self.connect() as conn:
            return conn.exchange(request)

    def forward_headers(
        self,
        tokens: int = 2,
        *,
        session: str | None = None,
        index: int = 0,
        total: int = 1,
        position: int | None = None,
        encoding: str | None = None,
        dtype: str = "float32",
    ) -> list[tuple[str, str]]:
        """A valid wire-2 head for this role; cases then add, drop or spoil one field.

        To a node every sequencing header is sent (a fresh session unless
        given); to a gateway only the ones given, as a client would.
        """
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("X-Meshnet-Wire", "2"),
            ("X-Meshnet-Shape", f"1,{tokens},{HIDDEN}"),
            ("X-Meshnet-Dtype", dtype),
        ]
        if self.role == "node" or session is not None:
            headers.append(("X-Meshnet-Session", session or new_session()))
        if self.role == "node" or index or total != 1:
            headers.append(("X-Meshnet-Chunk-Index", str(index)))
            headers.append(("X-Meshnet-Chunk-Total", str(total)))
        if encoding is not None:
            headers.append(("X-Meshnet-Encoding", encoding))
        if position is not None:
            headers.append(("X-Meshnet-Position", str(position)))
        return headers

    def forward(self, headers: Iterable[tuple[str, str]], body: bytes, **options: Any) -> bytes:
        return self.request("POST", "/forward", headers, body, **options)


Check = Callable[[Context], None]


@dataclass(frozen=True, slots=True)
class Case:
    """One requirement of the spec, checked against a live server."""

    id: str
    section: str
    description: str
    check: Check
    roles: Roles = BOTH
    needs_token: bool = False


def new_session() -> str:
    return str(uuid.uuid4())


def float32_body(tokens: int = 2, seed: int = 0) -> bytes:
    """``1 x tokens x HIDDEN`` finite float32 values, little-endian; ``seed`` varies them."""
    count = tokens * HIDDEN
    return struct.pack(f"<{count}f", *((seed * 1000 + i) * 0.25 for i in range(count)))


def replace_header(
    headers: list[tuple[str, str]], name: str, value: str | None
) -> list[tuple[str, str]]:
    """``headers`` with ``name`` set to ``value`` (appended if absent), or removed if None."""
    kept = [(key, val) for key, val in headers if key.lower() != name.lower()]
    return kept if value is None else [*kept, (name, value)]


# expect_error's ``header`` when the case does not say which header is named.
UNCHECKED = "<not checked>"


def expect_error(
    response: Response, status: int, code: str, *, header: str | None = UNCHECKED
) -> dict[str, Any]:
    """The §4 error answer: ``status``, JSON ``{"error": {...}}`` with ``code``.

    ``header`` (when given) is the lowercase header the error must name; None
    means the error must name none.
    """
    if response.status != status:
        raise CheckFailed(f"expected {status} {code}, got {response.summary()}")
    media = (response.header("content-type") or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise CheckFailed(f"{status} answered with Content-Type {media!r}, not application/json")
    document = response.json()
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        raise CheckFailed(f"{status} body has no 'error' object: {response.body[:120]!r}")
    for key, kind in (("status", int), ("code", str), ("message", str)):
        if not isinstance(error.get(key), kind):
            raise CheckFailed(f"error.{key} missing or not {kind.__name__}: {error!r}")
    for key in ("header", "hop"):
        if key not in error or not (error[key] is None or isinstance(error[key], str)):
            raise CheckFailed(f"error.{key} must be present, a string or null: {error!r}")
    if error["status"] != status:
        raise CheckFailed(f"error.status {error['status']} differs from the HTTP status {status}")
    if error["code"] != code:
        raise CheckFailed(f"expected code {code!r}, got {error['code']!r} ({status})")
    if header != UNCHECKED and error["header"] != header:
        raise CheckFailed(f"expected error.header {header!r}, got {error['header']!r}")
    return error


def expect_tensor(
    response: Response, *, shape: str, dtype: str = "float32", encoding: str = "identity"
) -> Response:
    """A 200 carrying a wire-2 tensor of ``shape``/``dtype`` in ``encoding``."""
    if response.status != 200:
        raise CheckFailed(f"expected 200 with a tensor, got {response.summary()}")
    wanted = {
        "content-type": "application/octet-stream",
        "x-meshnet-wire": "2",
        "x-meshnet-shape": shape,
        "x-meshnet-dtype": dtype,
        "x-meshnet-encoding": encoding,
    }
    for name, value in wanted.items():
        got = response.all(name)
        # Encoding may be left out for identity (its default).
        if name == "x-meshnet-encoding" and not got and value == "identity":
            continue
        if got != [value]:
            raise CheckFailed(f"response {name}: expected {value!r}, got {got}")
    if response.header("x-meshnet-position") is None:
        raise CheckFailed("a 200 response must carry X-Meshnet-Position")
    if encoding == "identity":
        count = 1
        for dim in shape.split(","):
            count *= int(dim)
        itemsize = 4 if dtype in ("float32", "int32") else 2
        if len(response.body) != count * itemsize:
            raise CheckFailed(
                f"identity body is {len(response.body)} bytes, "
                f"shape {shape} {dtype} is {count * itemsize}"
            )
    return response


def expect_status(response: Response, status: int) -> Response:
    if response.status != status:
        raise CheckFailed(f"expected {status}, got {response.summary()}")
    return response


def single(
    id: str,
    section: str,
    description: str,
    request: Callable[[Context], bytes],
    expect: Callable[[Response], object],
    *,
    roles: Roles = BOTH,
    needs_token: bool = False,
) -> Case:
    """A case of one request on a fresh connection and one expected answer."""

    def check(ctx: Context) -> None:
        expect(ctx.send(request(ctx)))

    return Case(id, section, description, check, roles, needs_token)

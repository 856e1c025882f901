"""Shared test configuration.

Async tests use ``pytest.mark.anyio``; the ``anyio_backend`` fixture below runs
each of them on both trio and asyncio, as the project promises.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on for the test (a busy port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()

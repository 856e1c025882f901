"""Shared test configuration.

Async tests use ``pytest.mark.anyio``; the ``anyio_backend`` fixture below runs
each of them on both trio and asyncio, as the project promises.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param

"""Shared test configuration.

Async tests use ``pytest.mark.anyio``; the ``anyio_backend`` fixture below runs
each of them on both trio and asyncio, as the project promises.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _own_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Nodes keep repacked weights under $XDG_CACHE_HOME (``--weights-cache``
    auto): the suite's processes use a directory of its own, never the user's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
    yield
    patch.undo()


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run only where torch sees a CUDA device (the GPU
    machine's ``.ci/gpu-check.sh``), and tests marked ``bf16_units`` only on
    a CPU that multiplies bfloat16 (AVX-512 BF16 or AMX: elsewhere a forced
    dense tile is 35x slower than int4pack, and auto never takes one).
    Elsewhere they are deselected, and pytest says how many: nothing is skipped."""
    for marker, present in (("cuda", _cuda), ("bf16_units", _bf16_units)):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if not marked or present():
            continue
        config.hook.pytest_deselected(items=marked)
        items[:] = [item for item in items if item.get_closest_marker(marker) is None]


def _cuda() -> bool:
    import torch  # only when a collected test needs it: torch is slow to import

    return bool(torch.cuda.is_available())


def _bf16_units() -> bool:
    import torch

    from meshnet_model.engines.torch.calibrate import bfloat16_units, cpu_features

    return bfloat16_units(cpu_features(torch))

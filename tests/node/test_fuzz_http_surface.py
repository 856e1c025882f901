"""The whole-HTTP-surface fuzz harness (fuzz/fuzz_http_surface.py), bounded, in CI.

Real HttpServer + NodeApp (plain, with a token, and a relay forwarding to a
loopback node) take mutated requests split at random points; every answer
must be well-formed HTTP with no 500, nothing logged as an error, no hang,
and every node must answer /health afterwards. The harness itself is shown
to catch a planted bug, and every input it ever flagged is replayed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshnet_node.app import NodeApp

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fuzz_http_surface", FUZZ / "fuzz_http_surface.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


harness = load_harness()
REGRESSIONS = sorted((FUZZ / "regressions").glob("http-*.bin"))
# A few seconds on the 2-core CI box; the long run is in fuzz/README.md.
CI_RUNS = 400

pytestmark = pytest.mark.anyio


async def test_bounded_fuzz_run_over_the_whole_http_surface() -> None:
    nodes = await harness.run_bounded_async(seconds=None, runs=CI_RUNS, seed=20261130)
    assert nodes.inputs == CI_RUNS
    # The run reached the application, not only the parser's refusals.
    assert {200, 400, 401, 404, 409} <= set(nodes.statuses)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
async def test_every_input_the_fuzzer_flagged_replays_cleanly(path: Path) -> None:
    async with harness.running_nodes() as nodes:
        await nodes.run_input(path.read_bytes())
        await nodes.check_alive()


async def test_the_harness_catches_an_unhandled_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    original = NodeApp.handle_endpoint

    async def buggy(self, event, ctx):
        if event.path == "/info":
            raise RuntimeError("planted bug")
        return await original(self, event, ctx)

    monkeypatch.setattr(NodeApp, "handle_endpoint", buggy)
    async with harness.running_nodes() as nodes:
        with pytest.raises(harness.InvariantBroken, match="500"):
            await nodes.run_input(harness.encode_input(b"GET /info HTTP/1.1\r\nHost: n\r\n\r\n"))
        nodes.errors.records.clear()
        await nodes.check_alive()  # the server survived its bug


def test_the_response_checker_refuses_what_a_server_must_not_send() -> None:
    ok = b"HTTP/1.1 204 No Content\r\n\r\n"
    error = b'{"error":{"status":404,"code":"not_found","message":"m","header":null,"hop":null}}'
    not_found = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)
    assert harness.check_responses(ok + not_found) == [204, 404]
    assert harness.check_responses(b"") == []
    for bad in (
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}",
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n",
    ):
        with pytest.raises(harness.InvariantBroken):
            harness.check_responses(bad)

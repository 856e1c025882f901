"""``meshnet run --stages 2`` as a user starts it: its two torch stages share the
machine's cores by who is busy (issue 39 part 5). Both nodes are members of one
core ledger, each may take every core, and in a one-stream generation — where
only one stage computes at a time — each stage's steps computed on all of
them. Before: each stage had ``cores // 2`` threads whatever the other did,
and ``/info`` had no ledger.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnet_model.engines.choice import usable_cores
from support.gateway import clean_env
from support.gguf import build_model, write_model_gguf

pytestmark = pytest.mark.slow


def _lines(proc: subprocess.Popen[bytes], count: int) -> list[str]:
    """The first ``count`` lines on its stdout, read as they come."""
    assert proc.stdout is not None
    seen = b""
    while seen.count(b"\n") < count:  # bounded: each read waits 180 s at most
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        assert ready, f"meshnet run said only {seen!r} within 180 s"
        data = os.read(proc.stdout.fileno(), 65536)
        assert data, f"meshnet run ended after {seen!r}"
        seen += data
    return seen.decode().splitlines()[:count]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """``meshnet run --stages 2`` on a small Q4_0 file: the gateway's URL and
    the nodes' (from the ready line and the node lines after it)."""
    model = write_model_gguf(tmp_path, build_model("llama", layers=2, hidden=128), "Q4_0")
    flags = ["--model", str(model), "--stages", "2", "--port", "0", "--log-level", "warning"]
    command = [sys.executable, "-m", "meshnet_cli", "run", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, env=clean_env())
    try:
        ready, *lines = _lines(proc, 3)
        assert ready.startswith("meshnet run listening on "), ready
        # "meshnet run node 1/2 at URL: layers 0:1", entry first
        nodes = [line.split(" at ", 1)[1].split(": layers")[0] for line in lines]
        yield ready.split()[4], nodes
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def _cores(node: str) -> dict[str, Any]:
    return _get(node + "/info")["stage"]["cores"]  # type: ignore[no-any-return]


def test_two_stages_share_one_ledger_and_a_lone_stream_computes_on_every_core(
    run: tuple[str, list[str]],
) -> None:
    url, nodes = run
    before = [_cores(node) for node in nodes]
    assert before[0]["file"] == before[1]["file"]
    cores = usable_cores()
    assert [(c["members"], c["busy"], c["cores"], c["most"]) for c in before] == [
        (2, 0, cores, cores)
    ] * 2
    model = _get(url + "/v1/models")["data"][0]["id"]
    document = {"model": model, "prompt": "Once upon a time", "max_tokens": 6}
    document |= {"ignore_eos": True, "temperature": 0}
    body, headers = json.dumps(document).encode(), {"Content-Type": "application/json"}
    request = urllib.request.Request(url + "/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 6
    after = [_cores(node) for node in nodes]
    # One stream: the stages compute in turn, so each decode step had every
    # core the machine had idle (all of them on a quiet one; a static split
    # gave each cores // 2) — the other stage's threads never counted.
    for c in after:
        assert (c["last_threads"], c["busy"]) == (max(1, min(cores, c["last_idle"])), 0)
    assert all(c["steps"] >= 2 for c in after)

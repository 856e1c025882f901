"""``meshnet run`` takes its servers' flags from their one flag table
(``--token``, ``--split``, limits, ``--shutdown-timeout``), prints its nodes
when ready, and its ready line ends with the resident memory (issue 22,
"Why" 6 and 7).

Before: ``--token`` was "unrecognized" (only MESHNET_TOKEN worked), there was
no way to give the split, no shutdown timeout, ``--help`` did not mention
GGUF, and the nodes' URLs were printed nowhere.
"""

from __future__ import annotations

import re
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from meshnet_cli.__main__ import build_parser
from meshnet_cli.run_flags import BOTH, GATEWAY_ONLY, NODE_ONLY, flag_table
from meshnet_gateway.config import GatewayConfig
from meshnet_node.config import NodeConfig
from support.gateway import clean_env
from support.gguf import build_model, write_model_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


def test_token_and_split_reach_the_gateway_and_every_node(tmp_path: Path) -> None:
    gguf = write_model_gguf(tmp_path, build_model("llama", 4, seed=5))
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_cli", "run", "--model", str(gguf), "--port", "0",
         "--token", "s3cret", "--split", "0:1,1:4", "--engine", "numpy"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # ends a hang only
        assert ready, "no ready line within 120 s"
        line = proc.stdout.readline().rstrip("\n")
        assert line.startswith("meshnet run listening on http://127.0.0.1:"), line
        assert "2 nodes, layers 0:1, 1:4)" in line, line
        assert re.search(r"\); rss [0-9][0-9,]* MiB$", line), line
        nodes = [proc.stdout.readline().rstrip("\n") for _ in range(2)]
        found = [re.fullmatch(r"meshnet run node (\d)/2 at (http://127\.0\.0\.1:\d+): "
                              r"layers (\d+:\d+)", n) for n in nodes]  # fmt: skip
        assert all(found), nodes
        assert [(m[1], m[3]) for m in found if m] == [("1", "0:1"), ("2", "1:4")]
        url = line.split(" listening on ", 1)[1].split()[0]
        assert _status(url + "/v1/models") == 401
        assert _status(url + "/v1/models", "s3cret") == 200
        for match in found:
            assert match is not None
            assert _status(match[2] + "/info") == 401  # the nodes require it too
            assert _status(match[2] + "/info", "s3cret") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_help_names_gguf_and_the_servers_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "run", "--help"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "a GGUF file (.gguf) or a checkpoint directory" in text
    for flag in ("--token", "--split", "--shutdown-timeout", "--max-running", "--max-sessions",
                 "--max-batch-tokens", "MESHNET_SHUTDOWN_TIMEOUT"):  # fmt: skip
        assert flag in text, flag
    assert "[env MESHNET_SHUTDOWN_TIMEOUT, default 5.0]" in text  # a few seconds, not 30


def test_every_forwarded_flag_is_the_servers_own() -> None:
    """One source: each of run's server flags is the very row of the node's
    or the gateway's table (same parser, same help), none written again."""
    table = flag_table()
    gateway = {flag.name: flag for flag in GatewayConfig.flags()}
    node = {flag.name: flag for flag in NodeConfig.flags()}
    for name in GATEWAY_ONLY + BOTH:
        assert table[name] is gateway[name], name
    for name in NODE_ONLY:
        assert table[name] is node[name], name
    for name in BOTH:
        assert node[name] is gateway[name], name  # a common flag: both take it


def test_run_keeps_a_flags_text_to_hand_on() -> None:
    args = build_parser().parse_args(["run", "--model", "m.gguf", "--micro-batches", "auto",
                                      "--kv-budget-bytes", "64MiB"])  # fmt: skip
    # Forwarded as typed: "auto" is what the node's parser takes, not its 0.
    assert (args.micro_batches, args.kv_budget_bytes) == ("auto", "64MiB")

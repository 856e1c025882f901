"""examples/blocking_server.py is a whole wire-2 node: ``meshnet conformance``
against it, run as a user runs both (two processes over loopback), fails no
case.

With a token, so that §7's access cases run too; the only cases left out are
a gateway's (the checker skips them for a node). The server is started on
port 0 and read for its ready line: no fixed port, no sleep.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blocking_server.py"
TOKEN = "example-conformance-token"


def test_meshnet_conformance_passes_against_the_blocking_example() -> None:
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", "0", "--token", TOKEN],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 120.0)  # ends a hang only
        assert ready, "the example server did not start"
        line = server.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        url = f"http://127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
        checker = [sys.executable, "-m", "meshnet_cli", "conformance", "--json", "--token", TOKEN]
        result = subprocess.run(
            [*checker, url], capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
    report = json.loads(result.stdout)
    failed = [f"{c['id']}: {c['detail']}" for c in report["cases"] if c["result"] == "fail"]
    assert failed == [], "\n".join(failed)
    assert report["role"] == "node"
    skipped = {c["id"] for c in report["cases"] if c["result"] == "skip"}
    assert all("gateway" in case for case in skipped), skipped
    assert report["counts"]["pass"] >= 150 and result.returncode == 0

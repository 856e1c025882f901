"""``meshnet status URL`` as a user types it, against real processes (issue 22,
"Why" 7: no view of the chain). A gateway and two stub nodes; the table must
name every node in stage order, healthy; a node's URL or a closed port is
one line on stderr and exit 2; a node gone shows as unreachable, exit 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.gateway import clean_env, closed_port_url, process_chain

pytestmark = pytest.mark.slow

LIMIT = 120  # seconds: only ends a hung test


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "status", *args],
        capture_output=True, text=True, timeout=LIMIT, env=clean_env(),
    )  # fmt: skip


def table(stdout: str) -> list[dict[str, str]]:
    """The rows under the header line, by column name."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STAGE"))
    names = lines[header].split()
    rows = []
    for line in lines[header + 1 :]:
        cells = line.split()
        if len(cells) != len(names) or not cells[0].isdigit():
            break
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def test_status_prints_the_chain_and_refuses_what_is_not_a_gateway() -> None:
    with process_chain(2) as (nodes, gateway, procs):
        shown = status(gateway)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines()[0] == f"gateway  entry {nodes[0]}"
        rows = table(shown.stdout)
        assert [(r["STAGE"], r["URL"]) for r in rows] == [("0", nodes[0]), ("1", nodes[1])]
        assert {(r["LAYERS"], r["WEIGHTS"], r["HEALTH"], r["SESSIONS"]) for r in rows} == {
            ("echo", "-", "ok", "0")
        }
        as_json = status(gateway, "--json")
        assert as_json.returncode == 0
        document = json.loads(as_json.stdout)
        assert [s["replicas"][0]["url"] for s in document["stages"]] == nodes

        # A node is not a gateway; a closed port is nobody: one line each, exit 2.
        for url, says in ((nodes[0], "not a gateway"), (closed_port_url(), "cannot read /info")):
            refused = status(url)
            assert (refused.returncode, refused.stdout) == (2, "")
            assert refused.stderr.startswith(f"meshnet status: {url}: {says}")
            assert refused.stderr.count("\n") == 1, refused.stderr

        # The last node gone: its row says so, the walk says why, exit 1.
        procs[0].kill()
        procs[0].wait()
        degraded = status(gateway)
        assert degraded.returncode == 1, degraded.stderr
        rows = table(degraded.stdout)
        assert [(r["URL"], r["HEALTH"]) for r in rows] == [
            (nodes[0], "ok"), (nodes[1], "unreachable"),
        ]  # fmt: skip
        assert "the walk stopped: no replica of stage 1 answered" in degraded.stdout

"""meshnet-gateway as a user starts it: subprocesses, ready lines, SIGTERM → exit 0."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from meshnet_gateway import RemoteError, forward_via_chain, forward_via_gateway
from meshnet_proto import MeshnetError
from support.gateway import (
    activation,
    clean_env,
    closed_port_url,
    process_chain,
    same_bits,
    spawn,
    stop,
)

pytestmark = pytest.mark.slow


def test_chain_of_processes_serves_and_shuts_down_cleanly() -> None:
    array = activation(512, 128)

    async def drive(gateway: str, entry: str) -> None:
        with anyio.fail_after(30):
            via_gateway = await forward_via_gateway(gateway, array)
            assert same_bits(via_gateway.output, array)
            # The key the gateway minted for the session comes with its answer.
            assert via_gateway.key is not None
            continued = await forward_via_gateway(gateway, array[:, :5],
                                                  session=via_gateway.session,
                                                  key=via_gateway.key)  # fmt: skip
            assert continued.position == 512
            via_chain = await forward_via_chain(entry, array, chunk_tokens=128)
            assert [h.chunk_index for h in via_chain.chunk_headers] == [0, 1, 2, 3]
            assert same_bits(via_chain.output, array)

    with process_chain(2, gateway_flags=["--inflight", "4"]) as (nodes, gateway, procs):
        anyio.run(drive, gateway, nodes[0], backend="trio")
        # Gateway first, then the nodes from the entry down: each exits 0.
        codes = [stop(procs[-1]), *[stop(p) for p in reversed(procs[:-1])]]
    assert codes == [0, 0, 0]


def test_gateway_ready_line_and_env_flags() -> None:
    env = clean_env() | {"MESHNET_CHUNK_TOKENS": "64", "MESHNET_INFLIGHT": "3"}
    down = closed_port_url()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_gateway", "--port", "0", "--entry", down],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the gateway prints it or exits
        assert line.startswith("meshnet-gateway listening on http://127.0.0.1:"), line
        assert f"entry {down}" in line and "chunk-tokens 64" in line
        # The entry is down: its window is unknown, so one chunk at a time.
        assert "inflight 1 [asked 3, entry window unknown]" in line

        async def drive(url: str) -> None:
            with anyio.fail_after(30), pytest.raises(MeshnetError) as caught:
                await forward_via_gateway(url, activation(4, 4))
            assert (caught.value.status, caught.value.hop) == (502, down)

        anyio.run(drive, line.split()[3], backend="trio")
    finally:
        assert stop(proc) == 0


def test_gateway_without_entry_exits_2_with_a_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gateway", "--port", "0"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert done.returncode == 2 and "--entry" in done.stderr


def test_node_behind_the_gateway_dies_mid_session() -> None:
    """The last node is killed: the gateway answers 502 naming it, promptly."""
    with process_chain(2) as (nodes, gateway, procs):
        procs[0].kill()  # the last node
        procs[0].wait()

        async def drive() -> None:
            with anyio.fail_after(30), pytest.raises(RemoteError) as caught:
                await forward_via_gateway(gateway, activation(8, 8))
            assert (caught.value.status, caught.value.hop) == (502, nodes[1])

        anyio.run(drive, backend="trio")
        assert stop(procs[2]) == 0 and stop(procs[1]) == 0


def test_spawn_helper_reports_a_gateway_that_cannot_listen() -> None:
    proc, url = spawn("meshnet_node")
    try:
        port = url.rsplit(":", 1)[1]
        done = subprocess.run(
            [sys.executable, "-m", "meshnet_gateway", "--port", port, "--entry", url],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=30,
        )
        assert done.returncode == 2 and "cannot listen" in done.stderr  # refused: exit 2
    finally:
        assert stop(proc) == 0


def test_a_node_that_cannot_listen_says_so_in_one_line_and_exits_2() -> None:
    proc, url = spawn("meshnet_node")
    try:
        port = url.rsplit(":", 1)[1]
        done = subprocess.run(
            [sys.executable, "-m", "meshnet_node", "--port", port],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=30,
        )
        assert done.returncode == 2  # a refused setting, like every other (issue 22)
        assert done.stderr.startswith(f"meshnet-node: cannot listen on 127.0.0.1:{port}: ")
        assert "Traceback" not in done.stderr and done.stdout == ""
    finally:
        assert stop(proc) == 0

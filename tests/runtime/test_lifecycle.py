"""A server as a process (``meshnet_runtime.lifecycle``): refusals in one line
with their fix and exit 2, the ready line's resident memory, and shutdown —
the drain says what it waits for, a second signal quits at once (issue 22).

Real ``meshnet-node`` / ``meshnet-gateway`` processes, real signals.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from meshnet_runtime.config import OneLineParser, model_path_problem
from meshnet_runtime.lifecycle import listen_problem, resident_memory
from support.gateway import clean_env, spawn
from support.wire import raw_forward

pytestmark = pytest.mark.slow

RSS_END = re.compile(r"; rss [0-9][0-9,]* MiB$")


def refused(module: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


@pytest.mark.parametrize(
    ("module", "program", "args"),
    [
        ("meshnet_node", "meshnet-node", ()),
        ("meshnet_gateway", "meshnet-gateway", ("--entry", "http://127.0.0.1:9")),
    ],
)
def test_a_taken_port_is_exit_2_with_the_fix(
    module: str, program: str, args: tuple[str, ...], taken_port: int
) -> None:
    # Before: "cannot listen: [Errno 98] Address already in use", exit 1.
    assert refused(module, *args, "--port", str(taken_port)) == (
        f"{program}: cannot listen on 127.0.0.1:{taken_port}: address already in use "
        "(another process listens there: stop it, or choose another --port, 0 for a free one)"
    )


def test_a_bad_flag_is_one_line_not_the_usage_block() -> None:
    # Before: 25 lines of usage, then the error.
    assert refused("meshnet_node", "--model", "x.gguf", "--layers", "3") == (
        "meshnet-node: error: argument --layers: expected A:B (layers A..B-1), got '3' "
        "(see meshnet-node --help)"
    )


@pytest.mark.parametrize(
    ("module", "program", "args"),
    [
        ("meshnet_node", "meshnet-node", ()),
        ("meshnet_gateway", "meshnet-gateway", ("--entry", "http://127.0.0.1:9")),
    ],
)
def test_a_file_that_is_no_model_is_named_so(
    module: str, program: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("text\n")
    assert refused(module, *args, "--model", str(readme)) == (
        f"{program}: cannot load --model {readme}: a file but not a .gguf file (give a .gguf file "
        "or a checkpoint directory with config.json, HF layout)"
    )


def test_model_path_problem_passes_what_the_loader_should_read(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "m.GGUF").write_bytes(b"GGUF")
    assert model_path_problem(str(tmp_path / "ckpt")) is None
    assert model_path_problem(str(tmp_path / "m.GGUF")) is None
    assert "a directory without config.json" in str(model_path_problem(str(tmp_path)))


def test_listen_problem_names_a_fix_for_each_cause() -> None:
    def line(code: int, uds: str | None = None) -> str:
        return listen_problem(OSError(code, "Some Reason"), "10.9.9.9", 80, uds)

    assert line(errno.EACCES).endswith("(ports below 1024 need privileges: choose a --port "
                                       "from 1024 up)")  # fmt: skip
    assert "--host must be an address of this machine" in line(errno.EADDRNOTAVAIL)
    assert line(errno.EADDRINUSE, "/tmp/s").startswith("cannot listen on /tmp/s: some reason")
    assert "remove the stale socket file" in line(errno.EADDRINUSE, "/tmp/s")


def test_one_line_parser_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="prog")
    parser.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--n", "x"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "prog: error: argument --n: invalid int value: 'x' (see prog --help)\n"
    )


def test_resident_memory_reads_vmrss() -> None:
    found = re.fullmatch(r"rss ([0-9][0-9,]*) MiB", resident_memory())
    assert found is not None and int(found[1].replace(",", "")) > 0


def test_node_and_gateway_ready_lines_end_with_the_resident_memory() -> None:
    node, node_url = spawn("meshnet_node")
    try:
        node_line = _first_line("meshnet_node")
        gateway_line = _first_line("meshnet_gateway", "--entry", node_url)
    finally:
        node.kill()
        node.wait()
    assert node_line.startswith("meshnet-node listening on http://127.0.0.1:"), node_line
    assert gateway_line.startswith("meshnet-gateway listening on http://127.0.0.1:")
    assert RSS_END.search(node_line) and RSS_END.search(gateway_line), (node_line, gateway_line)


def _first_line(module: str, *args: str) -> str:
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # ends a hang only
        assert ready, f"{module}: no ready line within 120 s"
        return proc.stdout.readline().rstrip("\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _stderr_until(proc: subprocess.Popen[bytes], text: bytes) -> bytes:
    """stderr read until a line holds ``text`` (bounded: 60 s per read, 1 MiB).

    Raw reads of the pipe: a buffered readline could hold the line wanted
    while select waits for more bytes."""
    assert proc.stderr is not None
    seen = b""
    while len(seen) < 2**20:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, f"no stderr line with {text!r}: {seen!r}"
        data = os.read(proc.stderr.fileno(), 65536)
        assert data, f"stderr ended before a line with {text!r}: {seen!r}"
        seen += data
        if text in seen and seen.endswith(b"\n"):
            return seen
    raise AssertionError(f"no stderr line with {text!r}")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_first_signal_says_what_it_drains_and_a_second_quits_at_once(backend: str) -> None:
    """Before: the drain said nothing at the default level and a second
    SIGTERM was ignored — the request below would hold the process 60 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_node", "--port", "0", "--delay-ms", "120000",
         "--shutdown-timeout", "60", "--async-backend", backend],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    busy: socket.socket | None = None
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no ready line within 120 s"
        url = proc.stdout.readline().decode().split(" listening on ", 1)[1].split()[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        busy = socket.create_connection((host, int(port)), timeout=30)
        busy.sendall(raw_forward(str(uuid.uuid4())))
        # One more request answered: the node has read the busy one's bytes by then.
        with socket.create_connection((host, int(port)), timeout=30) as other:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert other.recv(64).startswith(b"HTTP/1.1 200")
        proc.send_signal(signal.SIGTERM)
        seen = _stderr_until(proc, b"shutting down: draining").decode()
        drain = next(line for line in seen.splitlines() if "shutting down: draining" in line)
        assert f"{url} shutting down: draining 1 request in flight for up to 60 s " \
               "(--shutdown-timeout)" in drain  # fmt: skip
        assert drain.endswith("; a second SIGINT/SIGTERM (Ctrl-C) quits at once"), drain
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # not the 60 s drain, nor the 120 s stage
        assert proc.stderr is not None
        rest = seen + proc.stderr.read().decode()
        assert "SIGINT again: quitting at once" in rest and "Traceback" not in rest, rest
    finally:
        if busy is not None:
            busy.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

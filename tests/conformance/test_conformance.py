"""``meshnet conformance``: it passes against our node and gateway, and fails a broken server.

The checker runs as a user runs it (``python -m meshnet_cli conformance URL``)
against real processes on loopback. To show that it checks, it is also
pointed at two broken servers: our node behind a proxy that makes it accept
one bad header value (exactly that case must fail, by name), and a server
that answers everything 200 (it must fail, not crash).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshnet_conformance import ALL_CASES, check_server
from meshnet_model.testing import small_config, write_checkpoint
from support.gateway import clean_env, spawn, stop

pytestmark = pytest.mark.slow

TOKEN = "conformance-token-1"


def conformance(url: str, *args: str) -> tuple[int, dict, str]:
    """Run the CLI with --json; return its exit status, its document and stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "conformance", url, "--json", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def results(document: dict) -> dict[str, str]:
    return {case["id"]: case["result"] for case in document["cases"]}


@contextlib.contextmanager
def node(*args: str) -> Iterator[str]:
    proc, url = spawn("meshnet_node", *args)
    try:
        yield url
    finally:
        assert stop(proc) == 0


def test_the_node_passes_every_node_case() -> None:
    with node() as url:
        status, document, stderr = conformance(url)
    outcomes = results(document)
    failed = {case["id"]: case["detail"] for case in document["cases"] if case["result"] == "fail"}
    assert status == 0, (failed, stderr)
    assert document["role"] == "node"
    node_cases = {case.id for case in ALL_CASES if "node" in case.roles and not case.needs_token}
    assert {key for key, value in outcomes.items() if value == "pass"} == node_cases
    # The cases the brief names are among them.
    for case in ("2.dtype-case", "2.zstd-bomb", "2.order.sequencing-before-body", "3.replay",
                 "3.conflict", "3.runs", "3.wait-deadline", "4.deadline-spent"):  # fmt: skip
        assert outcomes[case] == "pass"


def test_a_model_stage_passes_the_kv_cases_with_a_real_export(tmp_path: Path) -> None:
    # A middle stage of a 3-layer model of hidden size 4 takes and gives
    # [1, tokens, 4] float32, as the checker's stage must: its KV is real, so
    # 3.kv.export checks a 200 KV message (rank 6, position, checksum) and
    # 3.kv.registration the node's handoff object, not the stub's refusals.
    config = small_config(hidden_size=4, intermediate_size=8, num_hidden_layers=3,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=4)  # fmt: skip
    model = write_checkpoint(tmp_path / "m", config, seed=3)
    with node("--model", str(model), "--layers", "1:2") as url:
        info = json.loads(urllib.request.urlopen(f"{url}/info", timeout=30).read())
        assert info["handoff"]["role"] == "any"  # a stage with KV: the real paths
        status, document, stderr = conformance(url, "--only", "3.kv")
    failed = {case["id"]: case["detail"] for case in document["cases"] if case["result"] == "fail"}
    assert status == 0, (failed, stderr)
    passed = {key for key, value in results(document).items() if value == "pass"}
    assert {"3.kv.export", "3.kv.registration", "3.kv.checksum-on-a-chunk"} <= passed


def test_the_gateway_passes_every_gateway_case_with_access_control() -> None:
    with node() as entry:
        proc, url = spawn("meshnet_gateway", "--entry", entry, "--token", TOKEN)
        try:
            status, document, stderr = conformance(url, "--token", TOKEN)
        finally:
            assert stop(proc) == 0
    assert status == 0, ([c for c in document["cases"] if c["result"] == "fail"], stderr)
    assert document["role"] == "gateway"
    outcomes = results(document)
    gateway_cases = {case.id for case in ALL_CASES if "gateway" in case.roles}
    assert {key for key, value in outcomes.items() if value == "pass"} == gateway_cases
    assert all(outcomes[case.id] == "pass" for case in ALL_CASES if case.section == "7")


def test_the_table_is_grouped_by_section_and_exit_0() -> None:
    with node() as url:
        proc = subprocess.run(
            [sys.executable, "-m", "meshnet_cli", "conformance", url, "--only", "6."],
            capture_output=True, text=True, env=clean_env(), timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert any(line.startswith("§6 ") for line in lines)
    assert sum(line.strip().startswith("PASS  6.") for line in lines) == 7
    assert "7 passed, 0 failed" in proc.stdout


# ------------------------------------------------------------ broken servers


@contextlib.contextmanager
def tcp_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback listener handing each connection to ``handle`` in a thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def accept() -> None:
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stopping.set()
        listener.close()
        thread.join(5)


def lenient_proxy(
    upstream: str, old: bytes = b"Float32", new: bytes = b"float32"
) -> Callable[[socket.socket], None]:
    """Our node, made to accept a dtype in the wrong case (``Float32``): one
    bug; or, given ``old`` and ``new``, whatever rewriting them makes."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)

    def pump(src: socket.socket, dst: socket.socket, fix: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data.replace(old, new) if fix else data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def handle(client: socket.socket) -> None:
        with client, socket.create_connection((host, int(port))) as server:
            back = threading.Thread(target=pump, args=(server, client, False), daemon=True)
            back.start()
            pump(client, server, True)
            back.join(30)

    return handle


def test_a_server_that_accepts_a_bad_header_fails_that_case_by_name() -> None:
    with node() as url, tcp_server(lenient_proxy(url)) as broken:
        status, document, _ = conformance(broken)
        table = subprocess.run(
            [sys.executable, "-m", "meshnet_cli", "conformance", broken, "--only", "2.dtype"],
            capture_output=True, text=True, env=clean_env(), timeout=120,
        )  # fmt: skip
    assert status == 1
    failed = [case for case in document["cases"] if case["result"] == "fail"]
    # Both cases that send "Float32" fail; nothing else does.
    assert [case["id"] for case in failed] == ["2.dtype-case", "2.early-error-closes"]
    assert "expected 400 bad_dtype, got 200" in failed[0]["detail"]
    assert table.returncode == 1
    assert "FAILED 2.dtype-case: expected 400 bad_dtype, got 200" in table.stdout


def test_a_node_that_ignores_the_sample_header_fails_exactly_the_sampling_cases() -> None:
    """wire-2 §3.13 checked: the header renamed on its way in, our node answers
    the logits row as an echo does; every case that needs a draw fails, nothing else."""
    with (
        node() as url,
        tcp_server(lenient_proxy(url, b"X-Meshnet-Sample", b"X-Meshnet-Other")) as broken,
    ):
        status, document, _ = conformance(broken)
    assert status == 1
    failed = {case["id"] for case in document["cases"] if case["result"] == "fail"}
    sampling = {case.id for case in ALL_CASES if case.id.startswith("3.sample.")}
    # The direct return's answer and stranger cases start from a sampled chunk too.
    sampling |= {"3.drawn.answer", "3.drawn.stranger"}
    # A window is a sampled chunk (§3.16): without the sample the node refuses
    # its draft (400 bad_draft), so the window cases whose chunks are
    # otherwise valid fail; the draft grammar cases still see bad_draft.
    windows = {case.id for case in ALL_CASES if case.id.startswith("3.window.")}
    sampling |= windows - {f"3.window.draft-{name}" for name in DRAFT_GRAMMAR}
    # A malformed mask is refused by its own header, sample or not (without
    # the sample it is refused for that): those cases still pass.
    sampling -= {f"3.sample.allow-{name}" for name in ("base64", "frame", "alone")}
    assert len(sampling) >= 12 and failed == sampling


DRAFT_GRAMMAR = ("grammar", "zero", "many", "big", "tokens", "unsampled")


def test_a_node_that_ignores_the_draft_header_fails_the_window_cases() -> None:
    """wire-2 §3.16 checked: X-Meshnet-Draft renamed on its way in, our node
    draws one token after a window's last row as a plain sampled chunk; the
    cases that verify a window fail, and so do those refusing a bad draft."""
    with (
        node() as url,
        tcp_server(lenient_proxy(url, b"X-Meshnet-Draft", b"X-Meshnet-Other")) as broken,
    ):
        status, document, _ = conformance(broken)
    assert status == 1
    failed = {case["id"] for case in document["cases"] if case["result"] == "fail"}
    assert {f"3.window.draft-{name}" for name in DRAFT_GRAMMAR} <= failed
    assert {"3.window.greedy", "3.window.seeded"} <= failed
    assert all(case.startswith("3.window.") for case in failed)


def always_200(conn: socket.socket) -> None:
    """A server that answers every request 200 with an empty JSON object."""
    with conn, contextlib.suppress(OSError):
        conn.settimeout(1)
        conn.recv(1 << 20)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")  # fmt: skip


def test_a_server_that_accepts_everything_fails_and_the_checker_survives_it() -> None:
    with tcp_server(always_200) as broken:
        ctx, outcomes = check_server(broken, timeout=10)
    by_id = {outcome.id: outcome for outcome in outcomes}
    assert ctx.role == "node"  # /info said nothing useful: the checker assumes a node
    assert by_id["2.zstd-bomb"].result == "fail"
    assert by_id["2.zstd-bomb"].detail == "expected 400 body_size_mismatch, got 200"
    assert by_id["2.valid"].result == "fail"  # no wire-2 headers on the 200
    assert by_id["6.health"].result == "pass"
    assert sum(outcome.result == "fail" for outcome in outcomes) > 60

"""``meshnet demo`` and ``meshnet send`` as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from support.gateway import activation, clean_env, process_chain, stop

pytestmark = pytest.mark.slow


def meshnet(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_cli", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=timeout,
    )


def test_demo_exits_0_and_prints_the_chunk_table() -> None:
    # --no-model: the wire check alone (the model's half: test_demo_model.py).
    done = meshnet("demo", "--no-model")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "chunk  position  shape" in out
    for index in range(4):
        assert f"{index}/4  " in out
    assert "1x128x4096  bfloat16  zstd" in out
    assert "wire 1, base64 in JSON" in out
    assert "check: chain output == input, bit for bit: yes" in out
    assert "check: gateway output == input, bit for bit: yes" in out


def test_demo_on_asyncio_with_inflight() -> None:
    done = meshnet(
        "demo", "--no-model", "--async-backend", "asyncio", "--inflight", "4", "--hidden", "256"
    )
    assert done.returncode == 0, done.stderr
    assert "--inflight 4" in done.stdout and "bit for bit: yes" in done.stdout


def test_send_round_trip_with_npy_files(tmp_path: Path) -> None:
    array = activation(300, 64)
    source, target = tmp_path / "in.npy", tmp_path / "out.npy"
    np.save(source, array)  # numpy writes bfloat16 as 2-byte void
    with process_chain(2) as (_, gateway, procs):
        done = meshnet("send", "--gateway", gateway, str(source), str(target))
        assert done.returncode == 0, done.stderr
        line = done.stdout.strip()
        session = line.split("session ")[1].split()[0]
        # The gateway minted the session's key (wire-2 §3.9): told once, on this line.
        key = line.split(" key ")[1].split(";")[0]
        assert len(key) == 32 and all(c in "0123456789abcdef" for c in key)
        assert line.startswith("sent 1x300x64 bfloat16 zstd") and "position 0" in line
        # Without the key, nobody (this one included) can go on with the session.
        stranger = meshnet(
            "send", "--gateway", gateway, "--session", session, str(source), "x.npy"
        )  # fmt: skip
        assert stranger.returncode == 1 and "403 session_forbidden" in stranger.stderr
        assert "--session-key" in stranger.stderr
        assert key not in stranger.stderr
        again = meshnet(
            "send", "--gateway", gateway, "--session", session, "--session-key", key,
            "--encoding", "identity", "--out-dtype", "wire", str(source),
            str(tmp_path / "again.npy"),
        )  # fmt: skip
        assert " key " not in again.stdout  # (told once, when the session was created)
        assert again.returncode == 0, again.stderr
        assert "position 300" in again.stdout and "identity" in again.stdout
        bad = meshnet("send", "--gateway", gateway, "--session", "nope", str(source), "x.npy")
        assert bad.returncode == 1 and "canonical lowercase" in bad.stderr
        for proc in reversed(procs):
            assert stop(proc) == 0
    # By default a bfloat16 answer is saved widened to float32 (exact), so
    # np.load gives numbers, not |V2 bytes; --out-dtype wire keeps the bits.
    output = np.load(target)
    assert output.dtype == np.float32 and "(float32)" in line
    assert np.array_equal(output, array.astype(np.float32))
    raw = np.load(tmp_path / "again.npy")
    assert raw.dtype == np.dtype("V2") and raw.shape == array.shape
    assert bytes(raw.view(ml_dtypes.bfloat16).view(np.uint8)) == bytes(array.view(np.uint8))


def test_send_refuses_a_non_wire_dtype(tmp_path: Path) -> None:
    source = tmp_path / "f64.npy"
    np.save(source, np.zeros((1, 4, 4)))
    done = meshnet("send", "--gateway", "http://127.0.0.1:9", str(source), "out.npy")
    assert done.returncode == 2 and "not a wire dtype" in done.stderr

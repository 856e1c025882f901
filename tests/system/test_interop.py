"""Interop with tools nobody here wrote: the ``zstd`` and ``curl`` command-line tools.

A request body compressed by ``zstd`` is accepted, a response body
decompresses with ``zstd -d``, and ``curl`` drives the gateway with raw
``.bin`` files (including a body over 1 MiB, for which curl sends
``Expect: 100-continue``, and a chunked upload). Skipped, visibly, only
where a binary is missing.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import anyio
import numpy as np
import pytest

from support.gateway import chain

pytestmark = pytest.mark.anyio

LIMIT = 30


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} binary not found")
    return path


async def run(*argv: str, stdin: bytes | None = None) -> bytes:
    with anyio.fail_after(LIMIT):
        done = await anyio.run_process(list(argv), input=stdin, check=False)
    assert done.returncode == 0, (argv, done.stderr.decode(errors="replace"))
    return done.stdout


def wire_headers(shape: str, dtype: str, encoding: str | None = None) -> list[str]:
    headers = [
        "Content-Type: application/octet-stream",
        f"X-Meshnet-Shape: {shape}",
        f"X-Meshnet-Dtype: {dtype}",
    ]
    if encoding is not None:
        headers.append(f"X-Meshnet-Encoding: {encoding}")
    return headers


async def curl(url: str, body: Path, headers: list[str], tmp: Path) -> tuple[int, dict, bytes]:
    """POST ``body`` with curl; (status, lowercase headers, body)."""
    out, head = tmp / f"{uuid.uuid4()}.out", tmp / f"{uuid.uuid4()}.head"
    argv = [need("curl"), "-sS", "-X", "POST", "--data-binary", f"@{body}",
            "-o", str(out), "-D", str(head), "-w", "%{http_code}"]  # fmt: skip
    for header in headers:
        argv += ["-H", header]
    status = int(await run(*argv, f"{url}/forward"))
    fields = {}
    for line in head.read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        if value:
            fields[name.strip().lower()] = value.strip()
    return status, fields, out.read_bytes()


def tensor(tokens: int, hidden: int) -> np.ndarray:
    rng = np.random.default_rng(5)
    # Rounded values: compressible, as activations after a quantising layer are.
    return np.round(rng.standard_normal((1, tokens, hidden)), 2).astype(np.float32)


async def test_zstd_cli_body_in_and_zstd_d_on_the_answer(tmp_path: Path) -> None:
    zstd = need("zstd")
    array = tensor(300, 64)
    raw = tmp_path / "in.bin"
    raw.write_bytes(array.tobytes())
    compressed = tmp_path / "in.bin.zst"
    await run(zstd, "-q", "-3", str(raw), "-o", str(compressed))
    async with chain(2) as c:
        status, fields, body = await curl(
            c.gateway.url, compressed, wire_headers("1,300,64", "float32", "zstd"), tmp_path
        )
        assert status == 200, body
        assert fields["x-meshnet-encoding"] == "zstd"
        assert fields["x-meshnet-shape"] == "1,300,64"
        assert fields["x-meshnet-position"] == "0"
        uuid.UUID(fields["x-meshnet-session"])
        answer = tmp_path / "out.bin.zst"
        answer.write_bytes(body)
        assert await run(zstd, "-q", "-d", "-c", str(answer)) == raw.read_bytes()


async def test_zstd_frame_without_content_size_is_accepted(tmp_path: Path) -> None:
    zstd = need("zstd")
    need("curl")
    array = tensor(130, 16)
    # Through a pipe zstd cannot know the size: the frame does not declare it.
    frame = await run(zstd, "-q", "-c", "--no-content-size", "-", stdin=array.tobytes())
    body = tmp_path / "in.zst"
    body.write_bytes(frame)
    async with chain(2) as c:
        status, _, answer = await curl(
            c.gateway.url, body, [*wire_headers("1,130,16", "float32", "zstd")], tmp_path
        )
    assert status == 200, answer
    restored = await run(zstd, "-q", "-d", "-c", "-", stdin=answer)
    assert restored == array.tobytes()


async def test_curl_drives_the_gateway_with_a_raw_bin(tmp_path: Path) -> None:
    array = tensor(1536, 256)  # 1.5 MiB: curl sends Expect: 100-continue
    raw = tmp_path / "in.bin"
    raw.write_bytes(array.tobytes())
    async with chain(2, gateway_flags=["--inflight", "2"]) as c:
        status, fields, body = await curl(
            c.gateway.url, raw, wire_headers("1,1536,256", "float32"), tmp_path
        )
        assert status == 200
        assert body == raw.read_bytes()
        assert fields["x-meshnet-encoding"] == "identity"
        assert fields["content-length"] == str(raw.stat().st_size)
        session = fields["x-meshnet-session"]
        # The gateway minted the session's key and says it once (wire-2 §3.9).
        key = fields["x-meshnet-session-key"]
        # Continue the session with its key; this time curl sends the body chunked.
        status, fields, body = await curl(
            c.gateway.url, raw,
            [*wire_headers("1,1536,256", "float32"), f"X-Meshnet-Session: {session}",
             f"X-Meshnet-Session-Key: {key}", "Transfer-Encoding: chunked"],
            tmp_path,
        )  # fmt: skip
        assert status == 200 and fields["x-meshnet-position"] == "1536"
        assert "x-meshnet-session-key" not in fields
        assert body == raw.read_bytes()


async def test_curl_gets_spec_errors(tmp_path: Path) -> None:
    raw = tmp_path / "in.bin"
    raw.write_bytes(bytes(64))
    async with chain(1) as c:
        status, fields, body = await curl(
            c.gateway.url, raw, wire_headers("1,4,4", "float64"), tmp_path
        )
        assert status == 415 and fields["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "unsupported_dtype"
        status, _, body = await curl(
            c.gateway.url, raw, ["Content-Type: application/json"], tmp_path
        )
        assert status == 415 and json.loads(body)["error"]["code"] == "wire1_gone"
        status, _, body = await curl(c.gateway.url, raw, wire_headers("1,4,5", "float32"), tmp_path)
        assert status == 400 and json.loads(body)["error"]["code"] == "body_size_mismatch"

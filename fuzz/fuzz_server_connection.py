"""Fuzz `ServerConnection` with one invariant.

Any bytes, split at any points and fed to a `ServerConnection` driven the
way a real driver drives it, yield only events — `ActivationHead`,
`ActivationReceived`, `EndpointRequest`, `ProtocolErrorReceived` (always a
4xx `MeshnetError`) or `ConnectionClosed` — and never raise. Every answer
the driver gives must be accepted too.

Two ways to run it (see fuzz/README.md):

* coverage-guided, with atheris (libFuzzer flags pass through)::

      python fuzz/fuzz_server_connection.py -max_total_time=300 [CORPUS_DIR]

* bounded, without atheris — random mutation of the built-in seed corpus,
  for CI::

      python fuzz/fuzz_server_connection.py --seconds 20 [--seed 1]

An input is the request bytes followed by a 4-byte trailer the fuzzer
mutates like the rest: flags (token on, gateway mode), a 16-bit seed for the
split points, and how many splits. `exercise()` is the core; the test suite
runs it too (tests/proto/test_fuzz_server_connection.py).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_ATHERIS_MODE = __name__ == "__main__" and not any(
    arg.startswith(("--seconds", "--runs", "--write-corpus")) for arg in sys.argv[1:]
)
try:
    import atheris
except ImportError:  # bounded mode needs nothing but the package
    atheris = None

if atheris is not None and _ATHERIS_MODE:
    with atheris.instrument_imports():
        import h11  # noqa: F401 - instrumented so coverage guides through the parser

        import meshnet_proto
else:
    import meshnet_proto  # noqa: F401

from meshnet_proto import (  # noqa: E402 - after the optional instrumentation
    NEED_DATA,
    ActivationHead,
    ActivationReceived,
    ConnectionClosed,
    EndpointRequest,
    Limits,
    MeshnetError,
    ProtocolErrorReceived,
    ServerConnection,
    WireHeaders,
    encode_tensor,
)

TOKEN = "fuzz-token"
SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
# Small tensors only: the fuzzer should spend its time in the parser, not in
# allocating the 512 MiB a fuzzed shape could legitimately ask for.
LIMITS = Limits(max_tensor_bytes=256 * 1024)
TRAILER = 4
EVENTS = (
    ActivationHead,
    ActivationReceived,
    EndpointRequest,
    ProtocolErrorReceived,
    ConnectionClosed,
)


def exercise(
    data: bytes, cuts: Sequence[int], *, token: str | None = None, require_sequencing: bool = True
) -> list[str]:
    """Feed ``data`` split at ``cuts`` (then EOF) to a fresh connection,
    answering every event as a driver would. Returns the event names.

    Raises AssertionError when the invariant breaks; any other exception
    escaping from here is a bug in the connection.
    """
    conn = ServerConnection(limits=LIMITS, token=token, require_sequencing=require_sequencing)
    bounds = sorted({cut for cut in cuts if 0 < cut < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *bounds], [*bounds, len(data)], strict=True)]
    seen: list[str] = []
    for piece in [*pieces, b""]:
        conn.receive_data(piece)
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                break
            # We answer every complete request at once, so PAUSED never shows.
            assert isinstance(event, EVENTS), f"not an event: {event!r}"
            seen.append(type(event).__name__)
            if isinstance(event, ActivationHead):
                assert isinstance(event.headers, WireHeaders)
                if event.expects_continue:
                    conn.send_continue()
            elif isinstance(event, ActivationReceived):
                assert not event.tensor.flags.writeable
                echo = event.headers.replace(encoding="identity")
                conn.send_activation(echo, encode_tensor(event.tensor))
            elif isinstance(event, EndpointRequest):
                conn.send_response(200, [(b"Content-Type", b"text/plain")], b"ok")
            elif isinstance(event, ProtocolErrorReceived):
                error = event.error
                assert isinstance(error, MeshnetError)
                assert 400 <= error.status < 500, error
                assert isinstance(error.code, str) and error.code
                conn.send_error(error)
                assert conn.should_close
                return seen
            else:
                assert conn.should_close
                return seen
    # After EOF, a connection always ends in an error or a close.
    raise AssertionError(f"no end after EOF: {seen}")


def decode_input(data: bytes) -> tuple[bytes, list[int], str | None, bool]:
    """Split a fuzz input into (request bytes, cuts, token, require_sequencing)."""
    if len(data) < TRAILER:
        return data, [], None, True
    payload, trailer = data[:-TRAILER], data[-TRAILER:]
    flags, seed_lo, seed_hi, count = trailer
    rng = random.Random(seed_lo | seed_hi << 8)
    cuts = [rng.randrange(len(payload) + 1) for _ in range(count % 16)]
    return payload, cuts, (TOKEN if flags & 1 else None), not flags & 2


def encode_input(payload: bytes, *, flags: int = 0, seed: int = 0, count: int = 0) -> bytes:
    return payload + bytes([flags, seed & 0xFF, seed >> 8 & 0xFF, count])


def run_input(data: bytes) -> list[str]:
    payload, cuts, token, require_sequencing = decode_input(data)
    return exercise(payload, cuts, token=token, require_sequencing=require_sequencing)


# ------------------------------------------------------------------ seed corpus


def _head(pairs: Sequence[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in pairs)


def _activation(
    *,
    encoding: str = "identity",
    chunked: bool = False,
    extra: Sequence[tuple[bytes, bytes]] = (),
    body: bytes | None = None,
    sequencing: bool = True,
) -> bytes:
    array = np.arange(12, dtype=np.float32).reshape(1, 4, 3)
    fields = {"session": SESSION, "chunk_index": 0, "chunk_total": 1} if sequencing else {}
    wire = WireHeaders.for_array(array, encoding=encoding, position=0, **fields)
    payload = bytes(encode_tensor(array, encoding=encoding)) if body is None else body
    head = b"POST /forward HTTP/1.1\r\nHost: n\r\n" + _head(wire.to_pairs()) + _head(extra)
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            len(payload),
            payload,
        )
    return head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload


def seed_corpus() -> list[bytes]:
    """Valid and invalid requests: every rule of wire-2 §2 has a seed near it."""
    auth = [(b"Authorization", b"Bearer " + TOKEN.encode())]
    valid = _activation()
    return [
        valid,
        valid + valid,  # pipelined
        _activation(encoding="zstd"),
        _activation(chunked=True),
        _activation(encoding="zstd", chunked=True),
        _activation(extra=[(b"Expect", b"100-continue")]),
        _activation(extra=auth),
        _activation(sequencing=False),
        valid + b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n",
        b"GET /health?deep=1 HTTP/1.1\r\nHost: n\r\n\r\n",
        b"GET /info HTTP/1.0\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: n\r\nConnection: close\r\n\r\n",
        b"DELETE /sessions/" + SESSION.encode() + b" HTTP/1.1\r\nHost: n\r\n\r\n",
        b"DELETE /sessions/x HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
        # invalid ones
        _activation(extra=[(b"Transfer-Encoding", b"chunked")]),
        _activation(extra=[(b"Transfer-Encoding", b"gzip")]),
        _activation(extra=[(b"Content-Length", b"7")]),
        _activation(body=b"short"),
        _activation(encoding="zstd", body=b"\x28\xb5\x2f\xfd" + b"\x00" * 20),
        _activation(extra=[(b"X-Meshnet-Wire", b"3")]),
        _activation(extra=[(b"X-Pad", b"x" * 17000)]),
        b"POST /forward HTTP/1.1\r\nHost: n\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"POST /forward HTTP/1.1\r\nHost: n\r\n\r\n",
        b"PUT /info HTTP/1.1\r\nHost: n\r\n\r\n",
        b"GET /nowhere HTTP/1.1\r\nHost: n\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00",  # a TLS ClientHello to a plain port
        b"",
    ]


# ------------------------------------------------------------------ mutation

# Fragments a random mutator would take forever to invent.
TOKENS = [
    b"\r\n",
    b"\r\n\r\n",
    b": ",
    b",",
    b"0",
    b"\x00",
    b" ",
    b"\t",
    b"Content-Length: 0\r\n",
    b"Content-Length: 99999999999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Expect: 100-continue\r\n",
    b"Connection: close\r\n",
    b"X-Meshnet-Shape: 1,65536,65536\r\n",
    b"X-Meshnet-Encoding: zstd\r\n",
    b"X-Meshnet-Dtype: bfloat16\r\n",
    b"ffffffffffffffff\r\n",
    b"0\r\n\r\n",
    b"HTTP/1.0",
]


def mutate(rng: random.Random, data: bytes, corpus: Sequence[bytes]) -> bytes:
    """One to four random edits: flips, inserts, deletes, duplicates,
    splices with another seed, and dictionary tokens."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randint(0, len(buf))
        if op == 0 and buf:
            index = rng.randrange(len(buf))
            buf[index] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2 and buf:
            del buf[pos : pos + rng.randint(1, 32)]
        elif op == 3 and buf:
            start = rng.randrange(len(buf))
            piece = buf[start : start + rng.randint(1, 64)]
            buf[pos:pos] = piece
        elif op == 4:
            other = rng.choice(corpus)
            buf = buf[:pos] + other[rng.randint(0, len(other)) :]
        elif op == 5:
            buf[pos:pos] = rng.choice(TOKENS)
        else:
            # Replace a run of digits-or-letters with a fresh number: lengths,
            # chunk sizes and dimensions live there.
            buf[pos : pos + rng.randint(0, 3)] = str(
                rng.choice([0, 1, 7, 255, 2**31, 2**64])
            ).encode()
    return bytes(buf)


def random_input(rng: random.Random, corpus: Sequence[bytes]) -> bytes:
    payload = rng.choice(corpus)
    if rng.random() < 0.9:
        payload = mutate(rng, payload, corpus)
    return encode_input(
        payload, flags=rng.randrange(4), seed=rng.randrange(1 << 16), count=rng.randrange(16)
    )


def run_bounded(*, seconds: float | None, runs: int | None, seed: int) -> int:
    rng = random.Random(seed)
    corpus = seed_corpus()
    deadline = time.monotonic() + seconds if seconds is not None else None
    count = 0
    while (runs is None or count < runs) and (deadline is None or time.monotonic() < deadline):
        data = random_input(rng, corpus) if count >= len(corpus) else encode_input(corpus[count])
        try:
            run_input(data)
        except Exception:
            name = f"crash-{hashlib.sha256(data).hexdigest()[:16]}.bin"
            Path(name).write_bytes(data)
            print(f"invariant broken after {count} inputs; input saved to {name}", file=sys.stderr)
            raise
        count += 1
    print(f"fuzz_server_connection: {count} inputs, no invariant broken (seed {seed})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if _ATHERIS_MODE and atheris is not None:
        atheris.Setup(argv, run_input)
        atheris.Fuzz()
        return 0  # pragma: no cover - atheris.Fuzz() exits the process
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, help="stop after this long")
    parser.add_argument("--runs", type=int, help="stop after this many inputs")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--write-corpus", metavar="DIR", help="write the seed corpus and exit")
    args = parser.parse_args(argv[1:])
    if args.write_corpus:
        directory = Path(args.write_corpus)
        directory.mkdir(parents=True, exist_ok=True)
        for index, payload in enumerate(seed_corpus()):
            (directory / f"seed-{index:03d}.bin").write_bytes(encode_input(payload))
        return 0
    if args.seconds is None and args.runs is None:
        parser.error("without atheris, give --seconds or --runs (bounded mode)")
    return run_bounded(seconds=args.seconds, runs=args.runs, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz a node's whole HTTP surface: the real HttpServer and NodeApp.

The invariant (issue 5): any bytes, split at any points and sent on a
connection to a running node, end in well-formed HTTP/1.1 responses or a
closed connection — never a 500 (an unhandled exception in the application),
never an error logged by the server, never a connection that hangs after the
client has finished sending, never a dead server: the node still answers
``GET /health`` afterwards. Unlike fuzz_server_connection.py (the sans-IO core
alone) this runs the drivers too: the serving loop, timeouts, the session
table, the stage, the codec pool and, for a relay, the forward downstream.

Three nodes run in one event loop for a whole fuzzing session, so state
carries from input to input as it does on a real node: ``plain`` (the last
stage), ``guarded`` (``--token``) and ``relay`` (``--next`` a real loopback
node). Their limits are small so the fuzzer reaches them: 32 sessions, 1 MiB
tensors, short timeouts.

Two ways to run it (fuzz/README.md):

* coverage-guided, with atheris (libFuzzer flags pass through)::

      python fuzz/fuzz_http_surface.py -max_total_time=300 [CORPUS_DIR]

* bounded, without atheris: random mutation of the seed corpus::

      python fuzz/fuzz_http_surface.py --seconds 20 [--seed 1]

An input is the bytes to send and a 4-byte trailer (target node, a seed for
the split points, how many splits), as in fuzz_server_connection.py, whose
seed corpus and mutator this reuses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

        import meshnet_node  # noqa: F401
        import meshnet_proto  # noqa: F401
        import meshnet_runtime  # noqa: F401

import anyio  # noqa: E402 - after the optional instrumentation
import anyio.abc  # noqa: E402
import anyio.from_thread  # noqa: E402
import fuzz_server_connection as core_fuzz  # noqa: E402
import surface_driver  # noqa: E402

from meshnet_node import build_node, serve_node  # noqa: E402
from meshnet_node.config import NodeConfig  # noqa: E402
from meshnet_runtime.http_server import HttpServer  # noqa: E402
from meshnet_runtime.transports import memory_stream_pair  # noqa: E402

TOKEN = core_fuzz.TOKEN
SESSION = core_fuzz.SESSION
TARGETS = ("plain", "guarded", "relay")
TRAILER = 4
# A connection whose client has sent everything and half-closed must be
# answered and closed well within this (every server timeout below is shorter).
HANG_SECONDS = 10.0
FLAGS = [
    "--max-sessions", "32",
    "--max-tensor-bytes", str(1 << 20),
    "--head-timeout", "1",
    "--reorder-timeout", "0.2",
    "--timeout", "3",
    "--session-ttl", "30",
    "--log-level", "warning",
]  # fmt: skip


class InvariantBroken(AssertionError):
    """The node did something the invariant forbids."""


# ------------------------------------------------------------------ responses


def check_responses(raw: bytes, *, head_requests: bool = False) -> list[int]:
    """The statuses of the HTTP/1.1 responses that make up ``raw``.

    Raises InvariantBroken unless ``raw`` is a sequence of well-formed
    responses (status line, headers, exactly ``Content-Length`` body bytes)
    with no 500, each 4xx/5xx a wire-2 §4 JSON error of its own status. A
    trailing partial response is not allowed either: the server closed, so
    what it sent must be whole. With ``head_requests`` (the input had a HEAD
    request) a response may carry headers only, as an answer to HEAD does.
    """
    statuses: list[int] = []
    rest = raw
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            raise InvariantBroken(f"incomplete response head: {head[:200]!r}")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or parts[0] != b"HTTP/1.1" or not parts[1].isdigit():
            raise InvariantBroken(f"bad status line: {lines[0][:200]!r}")
        status = int(parts[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or (name.lower() in headers and name.lower() == b"content-length"):
                raise InvariantBroken(f"bad header line: {line[:200]!r}")
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            statuses.append(status)
            continue
        if status == 204:
            length = 0
        else:
            if b"content-length" not in headers:
                raise InvariantBroken(f"{status} without Content-Length")
            length = int(headers[b"content-length"])
        if head_requests and (not rest or rest.startswith(b"HTTP/1.1 ")):
            length = 0  # an answer to HEAD: the length of the body it would have
        if len(rest) < length:
            raise InvariantBroken(f"{status}: body of {len(rest)} bytes for {length}")
        body, rest = rest[:length], rest[length:]
        if status == 500:
            raise InvariantBroken(f"500: {body[:300]!r}")
        if status >= 400 and not (head_requests and not body):
            try:
                error = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                quoted = body[:200]
                raise InvariantBroken(f"{status} without a wire-2 §4 body: {quoted!r}") from None
            if error.get("status") != status or not isinstance(error.get("code"), str):
                raise InvariantBroken(f"{status} with a mismatched error body: {error}")
        statuses.append(status)
    return statuses


# ------------------------------------------------------------------ the nodes


class _ErrorLog(logging.Handler):
    """Collects what the server logs at ERROR: an exception it did not expect."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Nodes:
    servers: dict[str, HttpServer]
    errors: _ErrorLog
    inputs: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    async def exchange(self, target: str, pieces: Sequence[bytes]) -> bytes:
        """Send ``pieces`` on a new connection, half-close, read to the end."""
        server = self.servers[target]
        client, server_end = memory_stream_pair()
        out = bytearray()
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve_stream, server_end)

            async def feed() -> None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    for piece in pieces:
                        await client.send(piece)
                    await client.send_eof()

            tg.start_soon(feed)
            with anyio.move_on_after(HANG_SECONDS) as scope:
                while True:
                    try:
                        out += await client.receive(1 << 16)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
                    except anyio.ClosedResourceError:
                        break
            if scope.cancelled_caught:
                tg.cancel_scope.cancel()
                raise InvariantBroken(f"{target}: no end {HANG_SECONDS} s after the client's")
            with anyio.move_on_after(HANG_SECONDS) as scope:
                await client.aclose()
            # serve_stream must end by itself once the connection is over.
        if scope.cancelled_caught:
            raise InvariantBroken(f"{target}: the server kept a finished connection")
        return bytes(out)

    async def run_input(self, data: bytes) -> list[int]:
        payload, cuts, target = decode_input(data)
        pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
        raw = await self.exchange(target, [p for p in pieces if p])
        statuses = check_responses(raw, head_requests=b"HEAD" in payload)
        if self.errors.records:
            record = self.errors.records[0]
            self.errors.records.clear()
            raise InvariantBroken(f"{target} logged an error: {record.getMessage()}")
        self.inputs += 1
        for status in statuses:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        return statuses

    async def check_alive(self) -> None:
        for target in TARGETS:
            raw = await self.exchange(target, [b"GET /health HTTP/1.1\r\nHost: n\r\n\r\n"])
            if check_responses(raw) != [200]:
                raise InvariantBroken(f"{target} no longer answers /health: {raw[:200]!r}")


@contextlib.asynccontextmanager
async def running_nodes() -> AsyncIterator[Nodes]:
    """The three nodes (and the relay's real downstream, on loopback)."""
    errors = _ErrorLog()
    logger = logging.getLogger("meshnet")
    logger.addHandler(errors)
    try:
        async with contextlib.AsyncExitStack() as stack:
            last = await stack.enter_async_context(
                serve_node(NodeConfig.load([*FLAGS, "--port", "0"], {}))
            )
            servers: dict[str, HttpServer] = {}
            for target, extra in (
                ("plain", []),
                ("guarded", ["--token", TOKEN]),
                ("relay", ["--next", last.url]),
            ):
                app, server = build_node(NodeConfig.load([*FLAGS, *extra], {}))
                stack.push_async_callback(app.aclose)
                servers[target] = server
            yield Nodes(servers, errors)
    finally:
        logger.removeHandler(errors)


# ------------------------------------------------------------------ inputs


def decode_input(data: bytes) -> tuple[bytes, list[int], str]:
    """(payload, sorted split points, target) from payload + 4-byte trailer."""
    payload, trailer = data[:-TRAILER], data[-TRAILER:].rjust(TRAILER, b"\0")
    target = TARGETS[trailer[0] % len(TARGETS)]
    rng = random.Random(int.from_bytes(trailer[1:3], "little"))
    count = trailer[3] % 16
    cuts = sorted({rng.randint(1, max(1, len(payload) - 1)) for _ in range(count)})
    return payload, [c for c in cuts if 0 < c < len(payload)], target


def encode_input(payload: bytes, *, target: int = 0, seed: int = 0, count: int = 0) -> bytes:
    return payload + bytes([target]) + seed.to_bytes(2, "little") + bytes([count])


def seed_corpus() -> list[bytes]:
    """The core harness's corpus, plus multi-chunk runs and sessions in flight."""
    auth = [(b"Authorization", b"Bearer " + TOKEN.encode())]
    run = b"".join(
        core_fuzz._activation(
            extra=[
                (b"X-Meshnet-Chunk-Index", b"%d" % i),
                (b"X-Meshnet-Chunk-Total", b"3"),
                (b"X-Meshnet-Position", b"%d" % (4 * i)),
            ],
            sequencing=False,
        ).replace(b"X-Meshnet-Position: 0\r\n", b"", 1)
        + b""
        for i in range(3)
    )
    session_line = b"X-Meshnet-Session: " + SESSION.encode() + b"\r\n"
    run = run.replace(b"Host: n\r\n", b"Host: n\r\n" + session_line)
    extra = [
        run,
        core_fuzz._activation(extra=[(b"X-Meshnet-Deadline-Ms", b"1")]),
        core_fuzz._activation(extra=[(b"Expect", b"100-continue"), *auth]),
        b"GET /health?deep=1 HTTP/1.1\r\nHost: n\r\n" + _auth_line() + b"\r\n",
        b"GET /info HTTP/1.1\r\nHost: n\r\n" + _auth_line() + b"\r\n",
    ]
    return [*core_fuzz.seed_corpus(), *extra]


def _auth_line() -> bytes:
    return b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"


def random_input(rng: random.Random, corpus: Sequence[bytes]) -> bytes:
    payload = rng.choice(corpus)
    if rng.random() < 0.9:
        payload = core_fuzz.mutate(rng, payload, corpus)
    return encode_input(
        payload,
        target=rng.randrange(len(TARGETS)),
        seed=rng.randrange(1 << 16),
        count=rng.randrange(16),
    )


def inputs(*, seconds: float | None, runs: int | None, seed: int) -> Iterator[bytes]:
    """The seed corpus (to every target), then random mutations, bounded."""
    rng = random.Random(seed)
    corpus = seed_corpus()
    deadline = time.monotonic() + seconds if seconds is not None else None
    count = 0
    seeds = [encode_input(c, target=t) for c in corpus for t in range(len(TARGETS))]
    while (runs is None or count < runs) and (deadline is None or time.monotonic() < deadline):
        yield seeds[count] if count < len(seeds) else random_input(rng, corpus)
        count += 1


async def run_bounded_async(
    *, seconds: float | None, runs: int | None, seed: int, alive_every: int = 50
) -> Nodes:
    """Run inputs until the bound; raise InvariantBroken (input saved) on a finding."""
    return await surface_driver.run_bounded(
        running_nodes,
        inputs(seconds=seconds, runs=runs, seed=seed),
        crash_prefix="http",
        broken=InvariantBroken,
        alive_every=alive_every,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if _ATHERIS_MODE and atheris is not None:
        surface_driver.atheris_main(argv, running_nodes)
        return 0  # pragma: no cover - atheris.Fuzz() exits the process
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    surface_driver.add_bounded_arguments(parser)
    parser.add_argument("--write-corpus", metavar="DIR", help="write the seed corpus and exit")
    args = parser.parse_args(argv[1:])
    if args.write_corpus:
        directory = Path(args.write_corpus)
        directory.mkdir(parents=True, exist_ok=True)
        for index, payload in enumerate(seed_corpus()):
            for target in range(len(TARGETS)):
                name = f"seed-{index:03d}-{TARGETS[target]}.bin"
                (directory / name).write_bytes(encode_input(payload, target=target))
        return 0
    if args.seconds is None and args.runs is None:
        parser.error("without atheris, give --seconds or --runs (bounded mode)")
    started = time.monotonic()
    nodes = anyio.run(
        lambda: run_bounded_async(seconds=args.seconds, runs=args.runs, seed=args.seed),
        backend=args.backend,
    )
    elapsed = time.monotonic() - started
    print(
        f"fuzz_http_surface: {nodes.inputs} inputs in {elapsed:.1f} s, no invariant broken "
        f"(seed {args.seed}, {args.backend}); statuses {dict(sorted(nodes.statuses.items()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

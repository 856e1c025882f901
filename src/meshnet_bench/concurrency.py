"""``meshnet bench`` section: aggregate throughput with 1, 8 and 64 sessions at once.

A gateway and two echo nodes run as separate processes on loopback; the
same total work (requests of the same size) is pushed through by 1, 8 and 64
concurrent sessions. The figure is the aggregate rate of input bytes
answered bit-exactly, and ``concurrency_scaling_64`` = rate at 64 ÷ rate at 1
(> 1: sessions overlap usefully; the ceiling is the machine's cores, since
each process is one Python event loop).
"""

from __future__ import annotations

import anyio

from ._load import drive, make_inputs, process_chain
from ._result import BenchOptions, SectionResult

__all__ = ["run"]

LEVELS = (1, 8, 64)
KEYS = ("concurrency_scaling_64", *(f"concurrency_mib_s_{n}" for n in LEVELS))


def _sizes(options: BenchOptions) -> tuple[int, int, int, int]:
    """(tokens per request, hidden, chunk tokens, requests in total per level)."""
    if options.tiny:
        return 16, 32, 8, 16
    if options.quick:
        return 256, 512, 64, 64  # 256 KiB requests, 16 MiB a level
    return 512, 1024, 128, 256  # 1 MiB requests, 256 MiB a level


def run(options: BenchOptions) -> SectionResult:
    tokens, hidden, chunk_tokens, total = _sizes(options)
    inputs = make_inputs(16, tokens, hidden, seed=6)
    request_bytes = inputs[0].nbytes
    result = SectionResult(title="Concurrent sessions (gateway + 2 nodes, processes, loopback)")
    rates: dict[int, float] = {}
    gateway_flags = ["--chunk-tokens", str(chunk_tokens), "--inflight", "4"]
    with process_chain(2, gateway_flags=gateway_flags) as chain:
        # One warm-up pass: connection pools, imports, allocator.
        anyio.run(_drive, chain.gateway_url, 8, inputs, 2, backend=options.async_backend)
        for sessions in LEVELS:
            per_session = max(1, total // sessions)
            options.progress(
                f"concurrency: {sessions} session(s) x {per_session} request(s) "
                f"of {request_bytes / 2**20:.2f} MiB"
            )
            stats = anyio.run(
                _drive,
                chain.gateway_url,
                sessions,
                inputs,
                per_session,
                backend=options.async_backend,
            )
            if stats.errors or stats.mismatches:
                raise RuntimeError(
                    f"{sessions} sessions: {stats.errors} errors, {stats.mismatches} "
                    f"mismatched answers ({stats.error_samples[:1]})"
                )
            rates[sessions] = stats.throughput
            result.rows.append(
                {
                    "sessions": str(sessions),
                    "requests": str(stats.requests),
                    "seconds": f"{stats.seconds:.2f}",
                    "MiB/s": f"{stats.throughput / 2**20:.1f}",
                    "vs 1 session": f"{stats.throughput / rates[1]:.2f}x",
                }
            )
    for sessions in LEVELS:
        result.keys[f"concurrency_mib_s_{sessions}"] = round(rates[sessions] / 2**20, 2)
    result.keys["concurrency_scaling_64"] = round(rates[64] / rates[1], 3) if rates[1] else None
    result.notes.append(
        f"same total work at each level ({total} requests of {tokens}x{hidden} bfloat16, "
        f"chunks of {chunk_tokens} tokens, --inflight 4); every answer checked bit-exact"
    )
    return result


async def _drive(url: str, sessions: int, inputs: list, per_session: int):  # type: ignore[no-untyped-def,type-arg]
    return await drive(url, sessions=sessions, inputs=inputs, requests_per_session=per_session)

"""Soak: keep a gateway and two nodes busy for a bounded time and watch their memory.

    python -m meshnet_bench.soak --seconds 180 [--sessions 16] [--interval 5] [--json]

Sessions come and go all the time (each continues its context for four
requests, then ends it with DELETE and starts another), so a leak per session, per request or
per connection shows as resident memory that keeps growing. Every
``--interval`` seconds the report prints the throughput of that interval and
the RSS of each process. After a warm-up (the first ``--warmup`` fraction of
the run: pools, allocator arenas and import-time caches settle there), the
largest RSS seen must stay within ``--max-growth-mib`` + ``--max-growth-pct``
of the RSS at the end of the warm-up, for every process; exit status 1 when
it does not, or when any answer was wrong or any request failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from ._load import LoadStats, drive, make_inputs, process_chain, rss_bytes

__all__ = ["SoakReport", "main", "soak"]


@dataclass(slots=True)
class SoakReport:
    samples: list[dict[str, float]]  # t, mib_s, rss_mib_<proc>...
    stats: LoadStats
    growth_mib: dict[str, float]
    bound_mib: dict[str, float]

    @property
    def ok(self) -> bool:
        grew = any(self.growth_mib[p] > self.bound_mib[p] for p in self.growth_mib)
        return not grew and not self.stats.errors and not self.stats.mismatches


def soak(
    seconds: float,
    *,
    sessions: int = 16,
    interval: float = 2.0,
    warmup: float = 0.3,
    tokens: int = 256,
    hidden: int = 256,
    chunk_tokens: int = 64,
    max_growth_mib: float = 16.0,
    max_growth_pct: float = 10.0,
    out: Callable[[str], object] = print,
) -> SoakReport:
    inputs = make_inputs(32, tokens, hidden, seed=11)
    flags = ["--chunk-tokens", str(chunk_tokens), "--inflight", "2"]
    with process_chain(2, gateway_flags=flags) as chain:
        names = list(chain.procs)
        stats = LoadStats()
        samples: list[dict[str, float]] = []
        started = time.monotonic()
        end = started + seconds

        async def sample_loop() -> None:
            last_bytes, last_t = 0, started
            header = ["t (s)", "MiB/s", *(f"{n} RSS MiB" for n in names)]
            out("  ".join(f"{h:>14}" for h in header))
            while time.monotonic() < end:  # bounded by --seconds
                await anyio.sleep(min(interval, max(end - time.monotonic(), 0.01)))
                now = time.monotonic()
                row: dict[str, float] = {
                    "t": round(now - started, 1),
                    "mib_s": round((stats.bytes - last_bytes) / (now - last_t) / 2**20, 2),
                }
                for name, proc in chain.procs.items():
                    row[f"rss_mib_{name}"] = round(rss_bytes(proc.pid) / 2**20, 1)
                samples.append(row)
                last_bytes, last_t = stats.bytes, now
                out("  ".join(f"{v:>14}" for v in row.values()))

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sample_loop)
                await drive(
                    chain.gateway_url,
                    sessions=sessions,
                    inputs=inputs,
                    until=end,
                    stats=stats,
                    context_requests=4,
                )

        anyio.run(main)
    settled = [s for s in samples if s["t"] >= seconds * warmup] or samples[-1:]
    growth: dict[str, float] = {}
    bound: dict[str, float] = {}
    for name in names:
        key = f"rss_mib_{name}"
        base = settled[0][key]
        growth[name] = round(max(s[key] for s in settled) - base, 1)
        bound[name] = round(max_growth_mib + base * max_growth_pct / 100, 1)
    return SoakReport(samples, stats, growth, bound)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshnet_bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=180.0, help="how long to run")
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.3, help="fraction of the run to settle")
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument("--max-growth-pct", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 24 * 3600 or args.sessions < 1 or args.interval <= 0:
        parser.error("--seconds must be in (0, 86400], --sessions >= 1, --interval > 0")
    report = soak(
        args.seconds,
        sessions=args.sessions,
        interval=args.interval,
        warmup=args.warmup,
        max_growth_mib=args.max_growth_mib,
        max_growth_pct=args.max_growth_pct,
    )
    s = report.stats
    print(
        f"requests {s.requests} ({s.bytes / 2**20:.0f} MiB) in {s.seconds:.1f} s: "
        f"{s.throughput / 2**20:.1f} MiB/s; errors {s.errors}, wrong answers {s.mismatches}"
    )
    for name, grown in report.growth_mib.items():
        verdict = "ok" if grown <= report.bound_mib[name] else "GREW"
        limit = report.bound_mib[name]
        print(f"{name}: RSS growth after warm-up {grown} MiB (bound {limit}) {verdict}")
    for sample in s.error_samples:
        print(f"error: {sample}")
    if args.json:
        print(
            json.dumps(
                {
                    "samples": report.samples,
                    "growth_mib": report.growth_mib,
                    "bound_mib": report.bound_mib,
                    "requests": s.requests,
                    "errors": s.errors,
                    "mismatches": s.mismatches,
                    "mib_s": round(s.throughput / 2**20, 2),
                }
            )
        )
    print("soak: ok" if report.ok else "soak: FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

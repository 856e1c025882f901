"""Gateway encoding across a real multi-host chain: identity vs zstd vs auto,
on an unlimited link and on a 100 Mbit/s token bucket.

    sudo .venv/bin/python benchmarks/bench_multihost.py [--rounds 5] [--mib 4]

Gateway, node 1 and node 2 each run in their own network namespace on a
bridge (``meshnet_bench._netns``); the client is in the root namespace.
Three gateways (``--encoding identity|zstd|auto``) share the same two nodes
(``--encoding mirror``, so every hop follows the gateway's choice) and are
measured in turns, round after round (the order rotating), so load drifts
hit all three alike.
Prints the median seconds per request and the ratio to identity, and what
the link-aware ``auto`` measured and chose for its chunks (``/info``). The
"answer" column is the encoding of the gateway's answer to the client, which
no link measurement steers (content-based ``auto``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio

from meshnet_bench._load import make_inputs
from meshnet_bench._netns import hosts, unavailable
from meshnet_gateway import Client

ENCODINGS = ("identity", "zstd", "auto")


async def _measure(urls: dict[str, str], inputs: list, rounds: int) -> dict[str, list[float]]:  # type: ignore[type-arg]
    times: dict[str, list[float]] = {e: [] for e in urls}
    picked: dict[str, set[str]] = {e: set() for e in urls}
    clients = {e: Client(url) for e, url in urls.items()}
    try:
        for client in clients.values():  # warm-up: connections, first session
            await client.forward(inputs[0], encoding="identity")
        names = list(clients)
        for r in range(rounds):
            # Rotate who goes first: each gateway follows each other equally often.
            for e in names[r % len(names) :] + names[: r % len(names)]:
                client = clients[e]
                array = inputs[r % len(inputs)]
                started = time.perf_counter()
                result = await client.forward(array, encoding="identity")
                times[e].append(time.perf_counter() - started)
                picked[e].add(result.headers.encoding)
                if result.output.tobytes() != array.tobytes():
                    raise RuntimeError(f"{e}: wrong answer")
        info = await clients["auto"].info()
        print(f"  auto at the gateway: {info['auto_encoding']}")
    finally:
        for client in clients.values():
            await client.aclose()
    times["_picked"] = picked  # type: ignore[assignment]
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=float, default=4.0, help="request size, MiB (bfloat16)")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--only-unlimited", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print every round's time")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"bench_multihost: skipped: {reason}")
        return 0
    hidden = 1024
    tokens = max(1, int(args.mib * 2**20 / (hidden * 2)))
    inputs = make_inputs(3, tokens, hidden, seed=5)
    size = inputs[0].nbytes
    with hosts(["gw", "n1", "n2"]) as net:
        _, n2 = net.spawn("n2", "meshnet_node", "--port", "8000")
        _, n1 = net.spawn("n1", "meshnet_node", "--port", "8000", "--next", n2)
        urls = {}
        for port, encoding in enumerate(ENCODINGS, start=8001):
            _, urls[encoding] = net.spawn("gw", "meshnet_gateway", "--port", str(port),
                                          "--entry", n1, "--encoding", encoding,
                                          "--inflight", "4", "--timeout", "120")  # fmt: skip
        print(f"request {size / 2**20:.1f} MiB bfloat16 ({tokens}x{hidden}), chunks of 128 "
              f"tokens, --inflight 4, gateway {net.address['gw']} -> "
              f"{net.address['n1']} -> {net.address['n2']}; median of {args.rounds}")  # fmt: skip
        print(f"{'link':>10} {'encoding':>9} {'answer':>8} {'s/request':>10} {'MiB/s':>8} "
              f"{'vs identity':>12}")  # fmt: skip
        for link in ("unlimited",) if args.only_unlimited else ("unlimited", args.rate):
            if link != "unlimited":
                for host in ("gw", "n1", "n2"):
                    net.shape(host, rate=link)
            times = anyio.run(_measure, urls, inputs, args.rounds, backend="trio")
            picked = times.pop("_picked")
            base = statistics.median(times["identity"])
            if args.verbose:
                for encoding in ENCODINGS:
                    print(f"  {encoding}: " + " ".join(f"{t:.3f}" for t in times[encoding]))
            for encoding in ENCODINGS:
                median = statistics.median(times[encoding])
                answer = ",".join(sorted(picked[encoding]))  # type: ignore[index]
                rate = size / median / 2**20
                print(f"{link:>10} {encoding:>9} {answer:>8} {median:>10.3f} {rate:>8.1f} "
                      f"{base / median:>11.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

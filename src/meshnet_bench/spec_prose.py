"""``python -m meshnet_bench.spec_prose [--rounds N] [--link PROFILE]``: does
speculation cost free prose anything?

Issue 38's finest line — prose, where prompt lookup finds little, must not
decode slower with speculation on — is a difference of a few per cent,
smaller than one round's spread on a shared machine. ``--only spec`` runs it
in one or two rounds among many tasks; this runs only it, in many paired
rounds: two gateways at once over the same real SmolLM2 two-stage chain
shape (``--speculate lookup``, the default, and ``--speculate off``), one
prose completion each per round, the order swapped every round, and prints
each round's ratio and the median of the ratios (pairs cancel the drift of
the machine's load between rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio

from .emulated_link import PROFILES
from .link import chain, model_file, retune
from .spec import TASKS, Trial, _chat, measure

__all__ = ["main", "paired_rounds"]

TREES: dict[str, tuple[str, ...]] = {"spec": (), "off": ("--speculate", "off")}
MAX_TOKENS = 128


async def paired_rounds(path: Path, rounds: int, link: str) -> list[tuple[Trial, Trial]]:
    """(speculation on, off) of each round, on ``link``, 2 stages."""
    call = anyio.to_thread.run_sync
    message = TASKS["prose"][0]
    pairs: list[tuple[Trial, Trial]] = []
    async with contextlib.AsyncExitStack() as stack:
        chains = {
            name: await stack.enter_async_context(chain(path, 2, flags, None))
            for name, flags in TREES.items()
        }
        for running in chains.values():
            retune(running, link)
            await call(_chat, running.gateway, path.stem, "Hello", 2)  # warm
        for r in range(rounds):
            order = ["spec", "off"] if r % 2 == 0 else ["off", "spec"]
            got = {
                name: await call(measure, chains[name], path.stem, message, MAX_TOKENS)
                for name in order
            }
            pairs.append((got["spec"], got["off"]))
            on, off = pairs[-1]
            print(
                f"round {r + 1}: spec {on.tok_s:.1f} tok/s, off {off.tok_s:.1f}, "
                f"ratio {on.tok_s / off.tok_s:.3f}, drafted {on.drafted:.0f}",
                flush=True,
            )
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshnet_bench.spec_prose")
    parser.add_argument("--rounds", type=int, default=10, choices=range(1, 101), metavar="N")
    parser.add_argument("--link", default="loopback", choices=sorted(PROFILES))
    # tiny: the test suite's smoke run (a toy model: its figures mean nothing)
    parser.add_argument("--model", default="real", choices=("real", "tiny"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        path = model_file(args.model, Path(scratch))
        pairs = anyio.run(paired_rounds, path, args.rounds, args.link)
    ratios = [on.tok_s / off.tok_s for on, off in pairs]
    same = all(on.text == off.text for on, off in pairs)
    print(
        f"prose on {args.link}, 2 stages, {len(pairs)} paired rounds: median spec "
        f"{statistics.median(on.tok_s for on, _ in pairs):.1f} tok/s, off "
        f"{statistics.median(off.tok_s for _, off in pairs):.1f}; ratio median "
        f"{statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}; same text: {'yes' if same else 'NO'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``meshnet bench --only link``: decode over emulated links, this tree against a baseline.

Every other figure of the bench is loopback, where the network is free. Here
each hop of a chain (gateway → node 1 → node 2 → …) crosses an
``EmulatedLink`` (a one-way delay and a rate per direction, in userspace:
these machines have no netem) on the named profiles — ``loopback``, ``lan``
(0.25 ms, 1 Gbit/s), ``wifi`` (5 ms, 100 Mbit/s), ``wan`` (20 ms, 50
Mbit/s) — and the chain is driven through its gateway's OpenAI API.

Two chains of node and gateway processes per model and stage count, one
after the other on the same links: this tree at its defaults (the last
stage draws, wire-2 §3.13), and the baseline — the tree before issue 36 when
``MESHNET_BENCH_BASELINE`` names a checkout of it (its ``src`` is the
processes' ``PYTHONPATH``), else this tree with ``--sample-at gateway`` (the
logits relayed up every hop). Per profile it prints decode tok/s, the TTFT of
a 512-token prompt, the bytes per token and hop in each direction, and ms per
token against the floor: the loopback ms per token (compute, on the same
chain) + the one-way delays a token's trip crosses (two per stage: there and
back) + its bytes at the rate.

Models: the real SmolLM2-135M-Instruct (49,152 ids: 192 KiB of logits a
token) and a generated Llama-shaped file with a 128,256-id vocabulary (Llama
3's: 501 KiB) and small layers, so that its figures are the network's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from ._needs import Need
from ._result import BenchOptions, SectionResult
from ._support import QUIET, server_process
from .emulated_link import PROFILES, EmulatedLink

__all__ = ["KEYS", "needs", "run"]

KEYS: tuple[str, ...] = (
    "link_wifi_decode_speedup",
    "link_wifi_bytes_up_per_token_hop",
    "link_wifi_ms_over_floor",
    "link_loopback_decode_ratio",
)
BASELINE_ENV = "MESHNET_BENCH_BASELINE"
PROMPT_TOKENS = 512
BIG_VOCAB = 128_256


@dataclass(frozen=True, slots=True)
class Plan:
    models: tuple[str, ...]  # "real", "big-vocab", "tiny"
    stages: tuple[int, ...]
    profiles: tuple[str, ...]
    decode_tokens: int
    prompt_tokens: int
    rounds: int  # each tree measured this many times, in turns; medians reported


def _plan(options: BenchOptions) -> Plan:
    if options.tiny:
        return Plan(("tiny",), (2,), ("loopback", "wifi"), 8, 16, 1)
    if options.quick:
        return Plan(("real",), (2,), ("loopback", "wifi"), 16, PROMPT_TOKENS, 3)
    return Plan(("real", "big-vocab"), (1, 2, 3), tuple(PROFILES), 24, PROMPT_TOKENS, 3)


@dataclass(frozen=True, slots=True)
class Trial:
    """One chain on one profile."""

    ttft_s: float  # a PROMPT_TOKENS prompt, one token
    ms_per_token: float  # decode, the prefill taken out
    # Per token and hop, as the issue counts them: "up" is what climbs back
    # toward the gateway (answers: the logits, or the drawn id), "down" what
    # goes toward the last stage (the token's hidden state).
    bytes_up: float
    bytes_down: float

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.ms_per_token


def crossings(stages: int, direct: bool) -> int:
    """One-way delays on a token's critical path: down every hop, then back
    through every hop, or straight from the last stage (wire-2 §3.14)."""
    return stages + 1 if direct and stages > 1 else 2 * stages


def floor_ms(
    trial: Trial, loopback: Trial, profile: str, stages: int, direct: bool = False
) -> float:
    """Loopback compute + the trip's one-way delays + its bytes at the rate."""
    link = PROFILES[profile]
    delays = crossings(stages, direct) * link.delay_s
    carried = stages * (trial.bytes_up + trial.bytes_down) * 8
    at_rate = carried / link.rate_bps if link.rate_bps else 0.0
    return loopback.ms_per_token + 1000.0 * (delays + at_rate)


# ------------------------------------------------------------ the chain


def model_file(name: str, directory: Path) -> Path:
    from ._serve_chain import model_file as serve_model

    if name == "big-vocab":
        return big_vocab_model(directory)
    return serve_model(name, directory)


def big_vocab_model(directory: Path) -> Path:
    """A random Llama-shaped GGUF: 4 small layers, Llama 3's 128,256 ids."""
    from ._serve_chain import byte_level_gguf

    # Byte tokens, one merged word (a BPE vocabulary needs a merge list),
    # fillers up to 128,256, and the end token.
    words = ["Ġt", *(f"w{i}" for i in range(BIG_VOCAB - 256 - 2)), "<|end|>"]
    shape = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    return byte_level_gguf(directory / "big-vocab.gguf", words, ["Ġ t"], shape, qtype="F16")


def _baseline_env() -> dict[str, str] | None:
    """The processes' environment for the baseline tree, or None (this tree)."""
    tree = os.environ.get(BASELINE_ENV)
    if not tree:
        return None
    src = Path(tree) / "src"
    if not (src / "meshnet_node").is_dir():
        raise RuntimeError(f"{BASELINE_ENV}={tree}: no src/meshnet_node there")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    env["PYTHONPATH"] = str(src)
    return env


@dataclass(slots=True)
class Chain:
    gateway: str
    links: list[EmulatedLink]  # links[i] carries the hop into stage i + 1


def _splits(path: Path, stages: int) -> list[tuple[int, int]]:
    from meshnet_model.source import load_config
    from meshnet_node.model_chain import even_splits

    return list(even_splits(load_config(path).num_hidden_layers, stages))


@contextlib.asynccontextmanager
async def chain(
    path: Path,
    stages: int,
    gateway_flags: Sequence[str],
    env: dict[str, str] | None,
    direct: bool = False,
) -> AsyncIterator[Chain]:
    """Node and gateway processes, last stage first, each hop behind a link;
    ``direct``: one more link, from the gateway to the last stage, which the
    gateway polls for each token (``--direct-return``, wire-2 §3.14)."""
    from meshnet_model.engines.choice import share_cores

    threads = ("--threads", str(share_cores(stages)))
    with contextlib.ExitStack() as stack:
        async with contextlib.AsyncExitStack() as links:
            hops: list[EmulatedLink] = []
            for a, b in reversed(_splits(path, stages)):
                argv = [*QUIET, "--model", str(path), "--layers", f"{a}:{b}", *threads]
                if hops:
                    argv += ["--next", hops[0].url_for()]
                _, url = stack.enter_context(
                    server_process("meshnet_node", *argv, timeout=300.0, env=env)
                )
                host, port = url.removeprefix("http://").rsplit(":", 1)
                hops.insert(
                    0,
                    await links.enter_async_context(
                        EmulatedLink.serving(host, int(port), up=PROFILES["loopback"])
                    ),
                )
            argv = [
                *QUIET,
                "--entry",
                hops[0].url_for(),
                "--model",
                str(path),
                "--no-prefix-cache",
                *gateway_flags,
            ]
            if direct and stages > 1:
                last_host, last_port = hops[-1].target
                back = await links.enter_async_context(
                    EmulatedLink.serving(last_host, last_port, up=PROFILES["loopback"])
                )
                argv += ["--direct-return", back.url_for()]
                hops.append(back)  # a hop of its own: its bytes count too
            _, gateway = stack.enter_context(
                server_process("meshnet_gateway", *argv, timeout=300.0, env=env)
            )
            yield Chain(gateway, hops)


# ------------------------------------------------------------ measuring


def _complete(url: str, model: str, prompt: list[int], tokens: int) -> float:
    """One greedy completion of exactly ``tokens`` ids; its wall time."""
    document = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(document).encode(),
        {"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        body = json.loads(answer.read())
    elapsed = time.perf_counter() - started
    if body["usage"]["completion_tokens"] != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {body['usage']}")
    return elapsed


def _prompt(count: int, salt: int) -> list[int]:
    """``count`` ids no other request of the run shares a prefix with."""
    return [(salt * 7919 + i * 31) % 200 + 3 for i in range(count)]


async def measure(chain: Chain, model: str, plan: Plan, salt: int, ttft: bool = True) -> Trial:
    """One round on one chain; ``ttft``: the 512-token prompt too (else NaN)."""
    call = anyio.to_thread.run_sync
    links = chain.links
    short = _prompt(8, salt)
    await call(_complete, chain.gateway, model, short, 1)  # warm: connections, caches
    carried = [(link.bytes_up, link.bytes_down) for link in links]
    one = await call(_complete, chain.gateway, model, _prompt(8, salt + 1), 1)
    middle = [(link.bytes_up, link.bytes_down) for link in links]
    many = await call(_complete, chain.gateway, model, _prompt(8, salt + 2), plan.decode_tokens)
    after = [(link.bytes_up, link.bytes_down) for link in links]
    first = math.nan
    if ttft:
        first = await call(
            _complete, chain.gateway, model, _prompt(plan.prompt_tokens, salt + 3), 1
        )
    steps = plan.decode_tokens - 1
    # Per token and hop: the long request's bytes less the one-token one's.
    # A link's own "up" is toward its target (the last stage): our "down".
    grown = [
        (2 * m[k] - b[k], c[k])
        for b, m, c in zip(carried, middle, after, strict=True)
        for k in (0, 1)
    ]
    toward_last = sum(c - g for g, c in grown[0::2])
    toward_gateway = sum(c - g for g, c in grown[1::2])
    hops = len(links) * steps
    return Trial(
        first,
        1000.0 * (many - one) / steps,
        max(toward_gateway, 0) / hops,
        max(toward_last, 0) / hops,
    )


def retune(chain: Chain, profile: str) -> None:
    for link in chain.links:
        link.retune(PROFILES[profile])


# ------------------------------------------------------------ the section


def median_trial(trials: Sequence[Trial]) -> Trial:
    """Each figure's median over the rounds (the TTFT: of those that took one)."""
    ttfts = [t.ttft_s for t in trials if not math.isnan(t.ttft_s)]
    return Trial(
        statistics.median(ttfts) if ttfts else math.nan,
        statistics.median(t.ms_per_token for t in trials),
        statistics.median(t.bytes_up for t in trials),
        statistics.median(t.bytes_down for t in trials),
    )


async def _trials(
    path: Path, model: str, stages: int, plan: Plan, trees: Sequence[Tree]
) -> dict[str, dict[str, Trial]]:
    """Every tree's chain at once (idle ones cost nothing), measured in turns
    on each profile — A, B, C, A, B, C: a burst of load falls on all alike."""
    async with contextlib.AsyncExitStack() as stack:
        chains: dict[str, Chain] = {}
        for tree in trees:
            started = chain(path, stages, tree.flags, tree.env, tree.direct)
            chains[tree.name] = await stack.enter_async_context(started)
        found: dict[str, dict[str, list[Trial]]] = {name: {} for name in chains}
        for k, profile in enumerate(plan.profiles):
            for running in chains.values():
                retune(running, profile)
            for round_ in range(plan.rounds):
                for t, (name, running) in enumerate(chains.items()):
                    salt = 1000 * t + 100 * k + 10 * round_
                    trial = await measure(running, model, plan, salt, ttft=round_ == 0)
                    found[name].setdefault(profile, []).append(trial)
        return {
            name: {profile: median_trial(trials) for profile, trials in per.items()}
            for name, per in found.items()
        }


def _row(
    model: str, stages: int, profile: str, tree: str, trial: Trial, floor: float
) -> dict[str, str]:
    return {
        "model": model,
        "stages": str(stages),
        "link": profile,
        "tree": tree,
        "decode tok/s": f"{trial.tok_s:.1f}",
        "TTFT 512": f"{trial.ttft_s:.2f} s",
        "up B/tok/hop": f"{trial.bytes_up:,.0f}",
        "down B/tok/hop": f"{trial.bytes_down:,.0f}",
        "ms/tok": f"{trial.ms_per_token:.1f}",
        "floor ms": f"{floor:.1f}",
        "/floor": f"{trial.ms_per_token / floor:.2f}",
    }


@dataclass(frozen=True, slots=True)
class Tree:
    """One way of running the chain: this tree's flags, or the baseline's."""

    name: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    direct: bool = False


def _trees(env: dict[str, str] | None) -> tuple[Tree, ...]:
    """ "after": the last stage samples and the gateway polls it directly;
    "relayed": it samples, its answers come back through every hop;
    "before": the baseline."""
    before = Tree("before", env=env) if env else Tree("before", ("--sample-at", "gateway"))
    # Speculation off: this section measures what a trip through the chain
    # costs, one token a trip (``--only spec`` measures several a trip).
    plain = ("--speculate", "off")
    return (Tree("after", plain, direct=True), Tree("relayed", plain), before)


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """The real model, but for the tiny file the test suite writes."""
    return () if options.tiny else (Need.MODEL,)


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    env = _baseline_env()
    baseline = (
        f"this tree against {os.environ[BASELINE_ENV]}"
        if env
        else "this tree against itself with --sample-at gateway (logits relayed)"
    )
    result = SectionResult(f"Decode over emulated links: {baseline}")
    found: dict[tuple[str, int, str, str], Trial] = {}
    trees = _trees(env)
    with tempfile.TemporaryDirectory() as scratch:
        for model in plan.models:
            path = model_file(model, Path(scratch))
            for stages in plan.stages:
                options.progress(f"  link: {model}, {stages} stages")
                measured = anyio.run(
                    _trials, path, path.stem, stages, plan, trees, backend=options.async_backend
                )
                for tree in trees:
                    trials = measured[tree.name]
                    for profile, trial in trials.items():
                        found[(model, stages, profile, tree.name)] = trial
                        floor = floor_ms(trial, trials["loopback"], profile, stages, tree.direct)
                        result.rows.append(_row(model, stages, profile, tree.name, trial, floor))
    _judge(result, found, plan)
    return result


def _judge(
    result: SectionResult, found: dict[tuple[str, int, str, str], Trial], plan: Plan
) -> None:
    """The issue's figures: wifi, 2 stages, the first model (the real one)."""
    model, stages = plan.models[0], 2 if 2 in plan.stages else plan.stages[0]
    wifi = "wifi" if "wifi" in plan.profiles else plan.profiles[-1]
    after, before = found[(model, stages, wifi, "after")], found[(model, stages, wifi, "before")]
    loop_after = found[(model, stages, "loopback", "after")]
    loop_before = found[(model, stages, "loopback", "before")]
    floor = floor_ms(after, loop_after, wifi, stages, direct=True)
    relayed = found[(model, stages, wifi, "relayed")]
    result.keys.update(
        {
            "link_wifi_decode_speedup": round(after.tok_s / before.tok_s, 2),
            "link_wifi_bytes_up_per_token_hop": round(after.bytes_up),
            "link_wifi_ms_over_floor": round(after.ms_per_token / floor, 2),
            "link_loopback_decode_ratio": round(loop_after.tok_s / loop_before.tok_s, 2),
        }
    )
    result.notes.append(
        f"{model}, {stages} stages, {wifi}: decode {after.tok_s:.1f} tok/s against "
        f"{before.tok_s:.1f} ({after.tok_s / before.tok_s:.2f}x); {after.bytes_up:,.0f} bytes up a "
        f"token and hop against {before.bytes_up:,.0f}; {after.ms_per_token:.1f} ms a token, "
        f"{after.ms_per_token / floor:.2f}x its floor ({floor:.1f} ms); answers relayed "
        f"instead of polled: {relayed.tok_s:.1f} tok/s"
    )

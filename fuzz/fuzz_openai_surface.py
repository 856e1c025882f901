"""Fuzz the gateway's OpenAI surface: /v1 JSON against a real model chain.

The invariant (issue 13): any request body on ``/v1/completions`` or
``/v1/chat/completions`` ends in a well-formed HTTP/1.1 answer — 200 (JSON,
or a stream of server-sent events ending in ``[DONE]`` or an error event),
or a 4xx with the OpenAI error body ``{"error": {"message", "type",
"param", "code"}}`` — never a 500, never a 5xx for what is only bad input,
never an error logged by the gateway or a node, never a hang; and the chain
still answers afterwards (``/health``, and a greedy completion equal to the
one before the run).

One chain runs in one event loop for the whole session, as a real one does:
two model nodes over a tiny random checkpoint (written to a temporary
directory, no download) and a gateway with ``--model`` and a short context
(``--max-context 48``), so that no input can make a generation long.

Two ways to run it (fuzz/README.md):

* coverage-guided, with atheris (libFuzzer flags pass through)::

      python fuzz/fuzz_openai_surface.py -max_total_time=300

* bounded, without atheris: structured mutation of a seed corpus of valid
  requests (hostile values spliced into fields, fields dropped, bytes
  flipped, cut or repeated, deep nesting)::

      python fuzz/fuzz_openai_surface.py --seconds 20 [--seed 1]

An input is one byte choosing the endpoint and the body bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The harnesses' shared driver sits beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from typing import Any

_ATHERIS_MODE = __name__ == "__main__" and not any(
    arg.startswith(("--seconds", "--runs")) for arg in sys.argv[1:]
)
try:
    import atheris
except ImportError:  # bounded mode needs nothing but the package
    atheris = None

if atheris is not None and _ATHERIS_MODE:
    with atheris.instrument_imports():
        import meshnet_gateway  # noqa: F401

import anyio  # noqa: E402
import anyio.abc  # noqa: E402
import anyio.from_thread  # noqa: E402
import surface_driver  # noqa: E402

from meshnet_gateway import open_gateway  # noqa: E402
from meshnet_gateway.config import GatewayConfig  # noqa: E402
from meshnet_gateway.openai.testing import write_tokenizer  # noqa: E402
from meshnet_model.testing import small_config, write_checkpoint  # noqa: E402
from meshnet_node.model_chain import start_model_chain  # noqa: E402

PATHS = ("/v1/completions", "/v1/chat/completions")
MODEL = "fuzz-model"
VOCAB = 320
HANG_SECONDS = 30.0
QUESTION = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0}


class InvariantBroken(AssertionError):
    """The gateway did something the invariant forbids."""


# ------------------------------------------------------------------ answers


def check_answer(raw: bytes) -> int:
    """The status of the one answer in ``raw``; InvariantBroken unless it is whole
    and as the invariant says."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise InvariantBroken(f"no complete answer: {raw[:200]!r}")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] != b"HTTP/1.1" or not parts[1].isdigit():
        raise InvariantBroken(f"bad status line: {lines[0][:200]!r}")
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        if status != 200 or b"text/event-stream" not in headers.get(b"content-type", b""):
            raise InvariantBroken(f"a chunked {status} that is not an event stream")
        _check_stream(body)
        return status
    length = int(headers.get(b"content-length", b"-1"))
    if length != len(body):
        raise InvariantBroken(f"{status}: body of {len(body)} bytes for {length}")
    if status >= 500:
        raise InvariantBroken(f"{status} for a request to a healthy chain: {body[:300]!r}")
    if status >= 400:
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            raise InvariantBroken(f"{status} without an error body: {body[:200]!r}") from None
        if not isinstance(error.get("message"), str) or "code" not in error:
            raise InvariantBroken(f"{status} with a malformed error body: {error}")
        if len(body) > 4096:
            raise InvariantBroken(f"{status}: an error body of {len(body)} bytes echoes input")
    return status


def _check_stream(chunked: bytes) -> None:
    text = b""
    rest = chunked
    while True:
        size, sep, rest = rest.partition(b"\r\n")
        if not sep:
            raise InvariantBroken("an event stream cut short")
        n = int(size, 16)
        if n == 0:
            break
        text, rest = text + rest[:n], rest[n + 2 :]
    events = [e for e in text.split(b"\n\n") if e]
    if events and events[-1] == b"data: [DONE]":
        return
    try:
        last = json.loads(events[-1].removeprefix(b"data: ")) if events else {}
    except ValueError:
        last = {}
    if isinstance(last, dict) and "error" in last:
        raise InvariantBroken(f"a stream ending in an error on a healthy chain: {last}")
    raise InvariantBroken(f"a stream ending neither in [DONE] nor an error: {events[-1:]}")


# ------------------------------------------------------------------ the chain


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Chain:
    url: str
    errors: _ErrorLog
    answer: str = ""
    inputs: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    async def post(self, path: str, body: bytes) -> bytes:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        data = (
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        out = bytearray()
        with anyio.move_on_after(HANG_SECONDS) as scope:
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(data)
                while True:
                    try:
                        out += await stream.receive(1 << 16)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
        if scope.cancelled_caught:
            raise InvariantBroken(f"no answer within {HANG_SECONDS} s")
        return bytes(out)

    async def run_input(self, data: bytes) -> int:
        path, body = decode_input(data)
        self.inputs += 1
        status = check_answer(await self.post(path, body))
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if self.errors.records:
            record = self.errors.records[0]
            raise InvariantBroken(f"logged an error: {record.getMessage()[:300]}")
        return status

    async def greedy_answer(self) -> str:
        raw = await self.post(PATHS[0], json.dumps(QUESTION).encode())
        if check_answer(raw) != 200:
            raise InvariantBroken(f"the chain no longer answers: {raw[:300]!r}")
        return str(json.loads(raw.partition(b"\r\n\r\n")[2])["choices"][0]["text"])

    async def check_alive(self) -> None:
        if await self.greedy_answer() != self.answer:
            raise InvariantBroken("the chain answers a question differently than before")


def write_model(root: Path) -> Path:
    config = small_config(vocab_size=VOCAB, max_position_embeddings=256)
    write_checkpoint(root, config, seed=5)
    write_tokenizer(root, VOCAB)
    return root


@contextlib.asynccontextmanager
async def running_chain() -> AsyncIterator[Chain]:
    errors = _ErrorLog()
    root_logger = logging.getLogger("meshnet")
    root_logger.addHandler(errors)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_model(Path(tmp) / MODEL)
            quiet = ["--log-level", "warning"]
            async with start_model_chain(model, [(0, 2), (2, 4)], extra=quiet) as nodes:
                flags = ["--port", "0", *quiet, "--entry", nodes[0].url, "--model", str(model),
                         "--max-context", "48", "--max-tokens-default", "4"]  # fmt: skip
                async with open_gateway(GatewayConfig.load(flags, {})) as gateway:
                    chain = Chain(gateway.url, errors)
                    chain.answer = await chain.greedy_answer()
                    yield chain
    finally:
        root_logger.removeHandler(errors)


# ------------------------------------------------------------------ inputs


def encode_input(path: str, body: bytes) -> bytes:
    return bytes([PATHS.index(path)]) + body


def decode_input(data: bytes) -> tuple[str, bytes]:
    if not data:
        return PATHS[0], b""
    return PATHS[data[0] % len(PATHS)], data[1:]


def seed_corpus() -> list[bytes]:
    completions = [
        {"model": MODEL, "prompt": "hello", "max_tokens": 2},
        {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0.7, "seed": 3},
        {
            "model": MODEL,
            "prompt": "a",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["x", "y"],
        },
        {"model": MODEL, "prompt": ["once"], "max_tokens": 2, "top_p": 0.5, "top_k": 3},
    ]
    chats = [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {
            "model": MODEL,
            "max_completion_tokens": 1,
            "stream": True,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x</s><|system|>y"}],
            "max_tokens": 1,
        },
    ]
    return [encode_input(PATHS[0], json.dumps(d).encode()) for d in completions] + [
        encode_input(PATHS[1], json.dumps(d).encode()) for d in chats
    ]


HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 2, 0.5, -0.0, 1e-307, 5e-324, 1e308, 10**30, 2**63, 2**64,
    -(2**63), "", "x", "\ud800", "\udfff", "\x00", "\u2028", "<|user|>", "</s>", "😀" * 3,
    "x" * 5000, [], {}, [1], ["a", "b"], [[1]], {"a": 1}, [None], [1.5], [True], [-1],
    [VOCAB], [0] * 300, [{"role": "user"}], [{"role": 1, "content": 2}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    {"include_usage": "yes"},
]  # fmt: skip
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
          "echo", "logit_bias", "presence_penalty", "frequency_penalty", "user",
          # docs/openai-api.md's table since issue 22: implemented, then refused by name
          "top_logprobs", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
          "stop_token_ids", "response_format", "best_of", "metadata", "prompt_cache_key",
          "safety_identifier", "tools", "tool_choice", "parallel_tool_calls", "functions",
          "function_call", "suffix", "audio", "prediction", "reasoning_effort",
          "web_search_options", "modalities", "store", "service_tier", "prompt_logprobs",
          "use_beam_search", "include_stop_str_in_output", "skip_special_tokens",
          "allowed_token_ids", "bad_words", "guided_json", "structured_outputs", "typical_p",
          "chat_template", "add_generation_prompt", "repeat_penalty", "n_probs",
          "grammar", "json_schema", "chat_template_kwargs", "continue_final_message",
          "documents", "guided_choice", "guided_grammar", "guided_regex", "length_penalty",
          "return_tokens_as_token_ids", "spaces_between_special_tokens",
          "truncate_prompt_tokens"]  # fmt: skip
RAW = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"9" * 5000, b'"\\ud800"', b"[" * 3000,
       b"{" * 3000, b'"\\u0000"', b"\xff\xfe", b'"\xed\xa0\x80"']  # fmt: skip


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One structured or byte-level mutation of a seed."""
    path, body = decode_input(data)
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        document = None
    choice = rng.random()
    if isinstance(document, dict) and choice < 0.55:
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(FIELDS)
            if rng.random() < 0.2:
                document.pop(name, None)
            else:
                document[name] = rng.choice(HOSTILE)
        document.setdefault("max_tokens", 2)  # keep generations short
        if isinstance(document.get("max_tokens"), int) and document["max_tokens"] > 4:
            document["max_tokens"] = rng.choice([4, document["max_tokens"]])
        body = json.dumps(document).encode()
    elif isinstance(document, dict) and choice < 0.7:
        # A raw JSON token no encoder would write, spliced in as a value.
        name = rng.choice(FIELDS).encode()
        body = body[:-1] + b', "' + name + b'": ' + rng.choice(RAW) + b"}"
    elif choice < 0.8:
        depth = rng.choice([100, 5000, 60_000])
        body = b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth
    else:
        array = bytearray(body)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            at = rng.randrange(len(array) + 1)
            if op < 0.4 and array:
                array[min(at, len(array) - 1)] = rng.randrange(256)
            elif op < 0.7:
                array[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            else:
                del array[at : at + rng.randint(1, 16)]
        body = bytes(array)
    if rng.random() < 0.1:
        path = rng.choice(PATHS)
    return encode_input(path, body)


def inputs(*, seconds: float | None, runs: int | None, seed: int) -> Iterator[bytes]:
    corpus = seed_corpus()
    yield from corpus
    rng = random.Random(seed)
    started, count = time.monotonic(), len(corpus)
    while (runs is None or count < runs) and (
        seconds is None or time.monotonic() - started < seconds
    ):
        count += 1
        yield mutate(rng.choice(corpus), rng)


async def run_bounded_async(
    *, seconds: float | None, runs: int | None, seed: int, alive_every: int = 50
) -> Chain:
    """Run inputs until the bound; raise InvariantBroken (input saved) on a finding."""
    return await surface_driver.run_bounded(
        running_chain,
        inputs(seconds=seconds, runs=runs, seed=seed),
        crash_prefix="openai",
        broken=InvariantBroken,
        alive_every=alive_every,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if _ATHERIS_MODE and atheris is not None:
        surface_driver.atheris_main(argv, running_chain)
        return 0  # pragma: no cover - atheris.Fuzz() exits the process
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    surface_driver.add_bounded_arguments(parser)
    args = parser.parse_args(argv[1:])
    if args.seconds is None and args.runs is None:
        parser.error("without atheris, give --seconds or --runs (bounded mode)")
    started = time.monotonic()
    chain = anyio.run(
        lambda: run_bounded_async(seconds=args.seconds, runs=args.runs, seed=args.seed),
        backend=args.backend,
    )
    print(
        f"fuzz_openai_surface: {chain.inputs} inputs in {time.monotonic() - started:.1f} s, "
        f"no invariant broken (seed {args.seed}, {args.backend}); statuses "
        f"{dict(sorted(chain.statuses.items()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

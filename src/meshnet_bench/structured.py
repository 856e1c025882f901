"""``meshnet bench`` section: what structured output costs a token of decode.

SmolLM2-135M-Instruct over two node processes and a gateway on loopback,
as ``meshnet run --stages 2`` configures them (``_serve_chain``). The same
chat prompts are streamed (``/v1/chat/completions``, temperature 0, a fixed
``max_tokens``) without and with a ``response_format`` of type
``json_schema`` (strict), one request at a time, plain and schema in turns
(their order flipped every round) so that a neighbour's load falls on both.
A constrained token costs one mask of llguidance's at the gateway, which
draws it from the logits the last stage relays (wire-2 §3.13), where a plain
token is drawn at the last stage.

Decode rate of a mode: every request's tokens after its first (the usage
event's ``completion_tokens`` - 1) over the time from its first content
event to its last, summed over the mode's requests (the first token is the
prefill's; TTFT is not what is compared). The acceptance target: schema
decode within 1.3x of plain (schema tok/s >= plain / 1.3).

Keys: ``structured_plain_tok_s``, ``structured_schema_tok_s``,
``structured_schema_over_plain`` (schema tok/s / plain tok/s) and
``structured_answers_valid`` (the schema answers that finished and parse as
JSON, of those that finished).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ._needs import Need
from ._result import BenchOptions, SectionResult
from ._serve_chain import Chain, model_file, start_chain
from ._serve_http import Stream, http, model_id

__all__ = ["KEYS", "TARGET", "needs", "run"]

KEYS = (
    "structured_plain_tok_s",
    "structured_schema_tok_s",
    "structured_schema_over_plain",
    "structured_answers_valid",
)
# The acceptance bound: schema decode within 1.3x of plain, as a floor on
# schema tok/s / plain tok/s (runner.TARGETS judges the key).
TARGET = 1.3


def _text(limit: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": limit}


def _closed(**properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _list(items: dict[str, Any], most: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


# (prompt, schema name, schema): answers long enough to decode for a while
# (strings of tens of characters, short lists) yet closed and bounded.
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "Tell me about Paris: its country, how many people live there, and three facts.",
        "city",
        _closed(
            name=_text(40),
            country=_text(40),
            population={"type": "integer", "minimum": 0, "maximum": 100_000_000},
            facts=_list(_text(80), 3),
        ),
    ),
    (
        "Give me a simple recipe for pancakes: a title, the ingredients and the minutes it takes.",
        "recipe",
        _closed(
            title=_text(60),
            ingredients=_list(_text(40), 6),
            minutes={"type": "integer", "minimum": 1, "maximum": 240},
        ),
    ),
    (
        "Review the film Inception: a summary, stars out of five, what is good and what is not.",
        "review",
        _closed(
            summary=_text(160),
            stars={"type": "integer", "minimum": 1, "maximum": 5},
            pros=_list(_text(60), 3),
            cons=_list(_text(60), 3),
        ),
    ),
)
SYSTEM = "You are a helpful assistant. Answer in JSON."


@dataclass(frozen=True, slots=True)
class _Plan:
    model: str  # "real" (SmolLM2-135M-Instruct Q4_1) or "tiny" (written here)
    rounds: int
    max_tokens: int


def _plan(options: BenchOptions) -> _Plan:
    if options.tiny:
        return _Plan("tiny", rounds=1, max_tokens=8)
    if options.quick:
        return _Plan("real", rounds=2, max_tokens=64)
    return _Plan("real", rounds=6, max_tokens=64)


@dataclass(slots=True)
class _Chat(Stream):
    """A chat completion's server-sent events: each content delta's arrival,
    the content, the finish reason, the usage event's token count."""

    pieces: list[str] = field(default_factory=list)
    finish: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        self._buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
            payload = b"\n".join(lines)
            if payload == b"[DONE]":
                self.done = True
            elif payload:
                self._event(json.loads(payload), now)

    def _event(self, document: dict[str, Any], now: float) -> None:
        if "error" in document:
            self.error = f"stream:{document['error'].get('code')}"
            return
        if document.get("usage"):
            self.usage_tokens = int(document["usage"]["completion_tokens"])
        for choice in document.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.pieces.append(content)
                self.times.append(now)
            self.finish = choice.get("finish_reason") or self.finish

    @property
    def decoded(self) -> tuple[int, float] | None:
        """(tokens after the first, seconds from the first content event to
        the last), or None when the stream had too little to time."""
        if self.error or not self.done or self.usage_tokens is None or len(self.times) < 2:
            return None
        return self.usage_tokens - 1, self.times[-1] - self.times[0]

    @property
    def parses(self) -> bool:
        try:
            json.loads("".join(self.pieces))
        except ValueError:
            return False
        return True


def _payload(
    model: str, case: tuple[str, str, dict[str, Any]], plan: _Plan, schema: bool
) -> dict[str, Any]:
    prompt, name, body = case
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": plan.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema:
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": body, "strict": True},
        }
    return payload


async def _chat(url: str, payload: dict[str, Any]) -> _Chat:
    stream = _Chat()
    status, body = await http(
        url, "POST", "/v1/chat/completions", json.dumps(payload).encode(), stream
    )
    if status != 200:
        mode = "schema" if "response_format" in payload else "plain"
        raise RuntimeError(f"a {mode} chat completion answered {status}: {body[:300]!r}")
    if stream.error is not None or not stream.done:
        raise RuntimeError(f"a chat completion's stream ended with {stream.error or 'no [DONE]'}")
    return stream


@dataclass(slots=True)
class _Measured:
    streams: dict[str, list[_Chat]] = field(default_factory=lambda: {"plain": [], "schema": []})

    def tok_s(self, mode: str) -> float:
        timed = [d for d in (s.decoded for s in self.streams[mode]) if d is not None]
        seconds = sum(s for _, s in timed)
        return sum(t for t, _ in timed) / seconds if seconds else 0.0

    def tokens(self, mode: str) -> int:
        return sum(d[0] for d in (s.decoded for s in self.streams[mode]) if d is not None)

    def seconds(self, mode: str) -> float:
        return sum(d[1] for d in (s.decoded for s in self.streams[mode]) if d is not None)


async def _measure(chain: Chain, plan: _Plan, progress: Callable[[str], None]) -> _Measured:
    model = await model_id(chain.gateway)
    # Untimed: the first constrained request builds llguidance's view of the
    # vocabulary (seconds for 49k tokens); the first of each warms the chain.
    for schema in (False, True):
        await _chat(chain.gateway, _payload(model, CASES[0], plan, schema))
    measured = _Measured()
    for round_ in range(plan.rounds):
        progress(f"  structured: round {round_ + 1}/{plan.rounds}")
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for case in CASES:
            for schema in order:
                stream = await _chat(chain.gateway, _payload(model, case, plan, schema))
                measured.streams["schema" if schema else "plain"].append(stream)
    return measured


def needs(options: BenchOptions) -> tuple[Need, ...]:
    """The real model, but for the tiny file the test suite writes."""
    return () if options.tiny else (Need.MODEL,)


def run(options: BenchOptions) -> SectionResult:
    plan = _plan(options)
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-structured-") as directory:
        path = model_file(plan.model, Path(directory))
        from meshnet_model.source import load_config

        layers = load_config(str(path)).num_hidden_layers
        options.progress(f"structured: {path.name}, {layers} layers over 2 nodes")
        with start_chain(path, layers) as chain:
            measured = anyio.run(
                _measure, chain, plan, options.progress, backend=options.async_backend
            )
    return _report(measured, plan, path.name)


def _report(measured: _Measured, plan: _Plan, model: str) -> SectionResult:
    plain, schema = measured.tok_s("plain"), measured.tok_s("schema")
    ratio = round(schema / plain, 3) if plain else None
    finished = [s for s in measured.streams["schema"] if s.finish == "stop"]
    valid = sum(s.parses for s in finished)
    result = SectionResult(
        title=f"Structured output: chat decode with and without a json_schema ({model}, "
        "gateway + 2 nodes, processes, loopback)",
        keys={
            "structured_plain_tok_s": round(plain, 2),
            "structured_schema_tok_s": round(schema, 2),
            "structured_schema_over_plain": ratio,
            "structured_answers_valid": f"{valid}/{len(finished)}",
        },
    )
    for mode, rate in (("plain", plain), ("json_schema", schema)):
        name = "schema" if mode == "json_schema" else mode
        result.rows.append(
            {
                "response_format": mode,
                "requests": str(len(measured.streams[name])),
                "decoded tokens": str(measured.tokens(name)),
                "decode s": f"{measured.seconds(name):.2f}",
                "tok/s": f"{rate:.1f}",
                "vs plain": f"{rate / plain:.2f}x" if plain else "n/a",
            }
        )
    met = ratio is not None and ratio >= round(1 / TARGET, 2)
    result.notes += [
        f"{len(CASES)} prompts x {plan.rounds} rounds a mode, temperature 0, max_tokens "
        f"{plan.max_tokens}, one request at a time, plain and schema in turns; decode: tokens "
        "after the first over first-to-last content event.",
        f"target: schema decode within {TARGET}x of plain (schema / plain >= "
        f"{1 / TARGET:.2f}): {ratio}: {'met' if met else 'not met'}",
        f"schema answers that finished (stop) and parse as JSON: {valid}/{len(finished)}, of "
        f"{len(measured.streams['schema'])} (the rest stopped at max_tokens)",
    ]
    return result

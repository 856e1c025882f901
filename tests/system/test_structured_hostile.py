"""Hostile JSON schemas against the real model's chain (SmolLM2-135M-Instruct
over two node processes behind a gateway process): every case of
``gateway.data.schemas.HOSTILE``, as ``response_format`` and as a tool's
``parameters`` with ``tool_choice`` "required", is either refused — a 400 in
OpenAI's shape whose ``code`` and ``param`` name the problem — or answered
within bounds — a 200 that stops at ``max_tokens`` ("length") or whose
content (or call's arguments) parses. Each answer comes within a bound, and
after them all the three processes are still up and a plain request gets
the greedy answer it got before the first case.

One chain for the module: loading the model costs ~10 s a process.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from support.model_surface import ModelChain, post, smollm2_chain
from support.security import Answer
from tests.gateway.data.schemas import HOSTILE, MISSING, Hostile, Raw, raw_json

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
# Every answer within this (a bounded answer is a prompt and 16 tokens of a
# 135M model on a shared CPU): a worker held by a schema fails the test
# instead of hanging the run. A refusal comes before any generation, so
# within far less whatever the schema (llguidance alone takes 2.5 s to give
# up on a 100,000-value enum; the gateway's size bound refuses it first).
BOUND_S = 90.0
REFUSAL_S = 15.0
ASK = [{"role": "user", "content": "Reply with JSON about the weather in Paris."}]
PLAIN = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
# Stands for a Raw value in the body until it is spliced in.
SLOT = "\u0000hostile\u0000"

# What a refusal's code says, by case: the gateway's bounds first (size,
# depth), then what is not a schema; any other refusal is llguidance's
# (``invalid_schema``, its reason in the message).
CODES = {
    "huge_80k": "schema_too_large",
    "enum_100k": "schema_too_large",
    "deep_40": "schema_too_deep",
    "schema_a_list": "invalid_type",
    "schema_a_string": "invalid_type",
    "schema_null": "invalid_type",
    "json_schema_a_string": "invalid_type",
    "json_schema_a_list": "invalid_type",
}
# 1,000 levels are refused by the body's parser, before any field is read:
# OpenAI's own answer to a body it cannot parse, with no code and no param.
UNPARSED = {"deep_1000"}
# A tool's parameters are written into the prompt: these pass the context.
TOO_LONG = {"regex_10k_chars", "wide_1000", "any_of_2000"}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelChain]:
    with smollm2_chain(tmp_path_factory.mktemp("structured-hostile")) as run:
        run.answer = _plain_answer(run)  # before any hostile request
        yield run


def _plain_answer(chain: ModelChain) -> str:
    document = {"model": chain.model, **PLAIN}
    answer = _bounded_post(chain, json.dumps(document).encode(), "/v1/completions")
    assert answer.status == 200, answer.body[:600]
    text = json.loads(answer.body)["choices"][0]["text"]
    assert isinstance(text, str) and "Paris" in text
    return text


def _bounded_post(chain: ModelChain, body: bytes, path: str = "/v1/chat/completions",
                  bound: float = BOUND_S) -> Answer:  # fmt: skip
    """POST ``path`` from a worker thread, failing after ``bound`` seconds."""

    async def bounded() -> Answer:
        with anyio.fail_after(bound):
            call = functools.partial(post, chain.gateway, path, body, timeout=bound + 5)
            return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)

    return anyio.run(bounded)


def _body(chain: ModelChain, case: Hostile, place: str) -> bytes:
    """The request: the case's schema as ``response_format``'s or as the only
    tool's, every other field ordinary."""
    value = SLOT if isinstance(case.schema, Raw) else case.schema
    document: dict[str, Any] = {"model": chain.model, "messages": ASK, "temperature": 0,
                                "max_tokens": MAX_TOKENS}  # fmt: skip
    if place == "response_format":
        spec: Any = {"name": case.name, "strict": True}
        if value is not MISSING:
            spec["schema"] = value
        document["response_format"] = {"type": "json_schema",
                                       "json_schema": value if case.whole else spec}  # fmt: skip
    else:
        function: Any = {"name": "report", "description": "Report the weather", "strict": True}
        if value is not MISSING:
            function["parameters"] = value
        document["tools"] = [{"type": "function", "function": value if case.whole else function}]
        document["tool_choice"] = "required"
    text = json.dumps(document)
    if isinstance(case.schema, Raw):
        text = text.replace(json.dumps(SLOT), raw_json(case.schema))
    return text.encode()


def _expected_error(case: Hostile, place: str) -> tuple[str | None, set[str | None]]:
    """The refusal's code and the params that name the problem (the field
    itself, or the request's parameter that holds it)."""
    if case.name in UNPARSED:
        return None, {None}
    if place == "tool" and case.name in TOO_LONG:
        return "context_length_exceeded", {"prompt", "messages", "tools"}
    if place == "response_format":
        field = "response_format.json_schema" + ("" if case.whole else ".schema")
        top = "response_format"
    else:
        field = "tools.[0].function" + ("" if case.whole else ".parameters")
        top = "tools"
    return CODES.get(case.name, "invalid_schema"), {field, top}


def _check_refused(answer: Answer, case: Hostile, place: str) -> None:
    assert answer.status == 400, (case.name, place, answer.status, answer.body[:400])
    error = answer.error
    code, params = _expected_error(case, place)
    assert error["type"] == "invalid_request_error", error
    assert (error["code"], error["param"] in params) == (code, True), error
    assert isinstance(error["message"], str) and error["message"], error


def _check_bounded(answer: Answer, case: Hostile, place: str) -> None:
    assert answer.status == 200, (case.name, place, answer.status, answer.body[:400])
    choice = json.loads(answer.body)["choices"][0]
    if choice["finish_reason"] == "length":
        return  # stopped at max_tokens: bounded, if not finished
    message = choice["message"]
    if place == "response_format":
        assert choice["finish_reason"] == "stop", choice
        json.loads(message["content"])
    else:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "report"
        json.loads(call["function"]["arguments"])


def _case(case: Hostile, place: str) -> Any:
    return pytest.param(case, place, id=f"{case.name}-{place}")


CASES = [_case(case, place) for case in HOSTILE for place in ("response_format", "tool")]


@pytest.mark.parametrize(("case", "place"), CASES)
def test_a_hostile_schema_is_refused_or_answered_within_bounds(
    chain: ModelChain, case: Hostile, place: str
) -> None:
    expected = case.as_format if place == "response_format" else case.as_tool
    bound = REFUSAL_S if expected == "refused" else BOUND_S
    answer = _bounded_post(chain, _body(chain, case, place), bound=bound)
    if expected == "refused":
        _check_refused(answer, case, place)
    else:
        _check_bounded(answer, case, place)


def test_more_than_128_tools_are_refused(chain: ModelChain) -> None:
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}}
             for i in range(129)]  # fmt: skip
    document = {"model": chain.model, "messages": ASK, "max_tokens": MAX_TOKENS, "tools": tools,
                "tool_choice": "required"}  # fmt: skip
    answer = _bounded_post(chain, json.dumps(document).encode(), bound=REFUSAL_S)
    assert answer.status == 400, answer.body[:400]
    assert (answer.error["param"], answer.error["code"]) == ("tools", "invalid_value")


def test_the_chain_is_up_after_and_answers_as_before(chain: ModelChain) -> None:
    # Last in the module: every hostile request above has been answered.
    for name, proc in chain.procs.items():
        assert proc.poll() is None, (name, chain.logs[name].read_text()[-2000:])
    assert _plain_answer(chain) == chain.answer

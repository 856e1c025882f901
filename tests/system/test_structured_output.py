"""Structured output and tool calls with the official ``openai`` client,
against the real model (SmolLM2-135M-Instruct, Q4_1) split over two node
processes behind the gateway: every answer parses and validates against
its schema, a forced tool call's arguments against its function's, and a
stream's deltas reassemble to the whole answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from gateway.data.schemas import CORPUS
from meshnet_cli.demo_traffic import Traffic, snapshot
from support.model_surface import ModelChain, smollm2_chain
from support.openai_client import client_for

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 24}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelChain]:
    with smollm2_chain(tmp_path_factory.mktemp("structured")) as run:
        run.answer = _plain_answer(client_for(run.gateway), run.model)
        yield run


def _plain_answer(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    return answer.choices[0].message.content or ""


@pytest.fixture(scope="module")
def client(chain: ModelChain) -> openai.OpenAI:
    return client_for(chain.gateway).with_options(timeout=300)


def _schema_answer(client: openai.OpenAI, model: str, entry: dict[str, Any]) -> tuple[Any, str]:
    prompt = f"Reply with a JSON {entry['name'].replace('_', ' ')}."
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_schema", "json_schema": {**entry, "strict": True}},
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = answer.choices[0]
    return choice.message.content, choice.finish_reason


def test_fifty_json_schema_answers_parse_and_validate(
    client: openai.OpenAI, chain: ModelChain
) -> None:
    assert len(CORPUS) == 50
    with ThreadPoolExecutor(8) as pool:  # the gateway batches them through the chain
        answers = list(pool.map(lambda e: _schema_answer(client, chain.model, e), CORPUS))
    unfinished = [(e["name"], c) for e, (c, f) in zip(CORPUS, answers, strict=True) if f != "stop"]
    assert not unfinished
    for entry, (content, _) in zip(CORPUS, answers, strict=True):
        jsonschema.validate(json.loads(content), entry["schema"])


def test_constrained_tokens_are_drawn_at_the_last_stage(
    client: openai.OpenAI, chain: ModelChain
) -> None:
    """The grammar's mask goes down with each step and the token comes up:
    the logits (49,152 float32, 192 KiB a token) never leave the last stage."""
    before = anyio.run(snapshot, chain.gateway, chain.nodes)
    content, finish = _schema_answer(client, chain.model, CORPUS[0])
    after = anyio.run(snapshot, chain.gateway, chain.nodes)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), CORPUS[0]["schema"])
    traffic = Traffic(before, after)
    tokens = traffic.gateway("meshnet_openai_completion_tokens_total")
    assert tokens > 5
    for hop in range(len(chain.nodes)):
        answered = traffic.node(hop, "meshnet_body_bytes_out_total", peer="upstream")
        assert answered < 64 * tokens + 4 * 4096  # ids (and the prompt's chunks), no rows


def test_json_object_answers_are_objects(client: openai.OpenAI, chain: ModelChain) -> None:
    answer = client.chat.completions.create(
        model=chain.model,
        messages=[{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    content = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_call_validates_and_streams_the_same(
    client: openai.OpenAI, chain: ModelChain, choice: Any
) -> None:
    kwargs = {
        "model": chain.model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    schema = next(
        t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name
    )
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert whole.usage is not None and whole.usage.completion_tokens > 0

    # The same request streamed: the deltas, as the client accumulates
    # them, make the same call, and the usage comes last when asked.
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_tool_result_goes_back_into_the_conversation(
    client: openai.OpenAI, chain: ModelChain
) -> None:
    first = client.chat.completions.create(
        model=chain.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
        parallel_tool_calls=False,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=chain.model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_lets_the_model_answer_in_text_and_omits_null_fields(
    client: openai.OpenAI, chain: ModelChain
) -> None:
    answer = client.chat.completions.create(
        model=chain.model,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=30,
    )
    choice = answer.choices[0]
    assert choice.message.content  # SmolLM2 greets rather than calls
    # The raw body: no tool_calls key where there are none (vLLM omits it).
    raw = client.chat.completions.with_raw_response.create(
        model=chain.model,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=30,
    )
    message = json.loads(raw.http_response.text)["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == choice.message.content


def test_a_grammar_that_cannot_finish_stops_at_max_tokens(
    client: openai.OpenAI, chain: ModelChain
) -> None:
    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 10_000}
    answer = client.chat.completions.create(
        model=chain.model,
        messages=[{"role": "user", "content": "Numbers."}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": endless}},
        max_tokens=12,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert answer.choices[0].message.content.startswith("[")


def test_the_chain_answers_plainly_after(client: openai.OpenAI, chain: ModelChain) -> None:
    """Every constrained request above left the chain as it was: the greedy
    plain answer is the one given before any of them."""
    assert chain.answer and _plain_answer(client, chain.model) == chain.answer

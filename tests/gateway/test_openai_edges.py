"""Edges of the OpenAI surface a client meets before any generation: an
unknown /v1 path, a message's ``name`` and the other message fields, and
``stream_options`` without ``stream`` — each answered in OpenAI's error
shape with a code, never dropped without a word."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from meshnet_gateway.openai.errors import OpenAIError
from meshnet_gateway.openai.messages import check_names
from meshnet_gateway.openai.requests import parse_chat, parse_completion
from meshnet_gateway.openai.special_tokens import ChatEncoder
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from support.openai import fake_stages, post_json, serve_openai, write_model_dir

LIMIT = 30
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def request(url: str, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=LIMIT)
    try:
        conn.request(method, path, body=body or None)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.anyio
async def test_unknown_v1_paths_are_openai_shaped_404s(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "tiny-model")
    async with serve_openai(model_dir, stages=fake_stages(1)) as served:
        unknown = (
            ("POST", "/v1/embeddings"),
            ("GET", "/v1/responses"),
            ("POST", "/v1/audio/speech"),
        )
        for method, path in unknown:
            status, document = await anyio.to_thread.run_sync(
                request, served.url, method, path, b"{}" if method == "POST" else b""
            )
            assert status == 404, document
            assert set(document["error"]) == OPENAI_ERROR_KEYS, document
            error = document["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
            assert path in error["message"]
        # The served paths still answer as before.
        status, models = await anyio.to_thread.run_sync(request, served.url, "GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "tiny-model"
        # A message's name the fallback template ("role: content") never
        # writes: refused by name, not dropped.
        body = {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "hi", "name": "alice"}],
        }
        status, document = await anyio.to_thread.run_sync(
            post_json, served.url, "/v1/chat/completions", body
        )
        assert status == 400, document
        assert document["error"]["param"] == "messages.[0].name"
        assert document["error"]["code"] == "unsupported_parameter"


def error_of(parse: Any, document: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(document)
    return caught.value


def test_stream_options_without_stream_has_a_code() -> None:
    error = error_of(
        parse_completion, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}
    )
    assert (error.status, error.param, error.code) == (400, "stream_options", "invalid_value")


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        ({"name": "bad name!"}, "messages.[0].name", "invalid_value"),
        ({"name": "x" * 65}, "messages.[0].name", "invalid_value"),
        ({"name": 3}, "messages.[0].name", "invalid_value"),
        ({"tool_calls": [{"id": "1"}]}, "messages.[0].tool_calls", "invalid_value"),
        ({"function_call": {"name": "f"}}, "messages.[0].function_call", "unsupported_parameter"),
        ({"audio": {"id": "a"}}, "messages.[0].audio", "unsupported_parameter"),
    ],
)
def test_message_fields_are_checked_or_refused_by_name(
    message: dict[str, Any], param: str, code: str
) -> None:
    document = {"model": "m", "messages": [{"role": "user", "content": "hi", **message}]}
    error = error_of(parse_chat, document)
    assert (error.status, error.param, error.code) == (400, param, code)


NAMED_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}: "
    "{{ m['content'] }}\n{% endfor %}assistant: "
)


def test_a_name_reaches_a_template_that_writes_it(tmp_path: Path) -> None:
    root = write_tokenizer(tmp_path / "named")
    (root / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    tokenizer = ModelTokenizer.load(root)
    chat = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "alice"}]}
    )
    check_names(tokenizer, chat.messages)  # written: accepted
    ids = ChatEncoder(tokenizer).encode(chat.messages)
    assert tokenizer.decode(ids) == "user (alice): hi\nassistant: "
    plain = ModelTokenizer.load(write_tokenizer(tmp_path / "plain"))
    with pytest.raises(OpenAIError) as caught:
        check_names(plain, chat.messages)
    assert (caught.value.param, caught.value.code) == ("messages.[0].name", "unsupported_parameter")

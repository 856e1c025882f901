"""Parsing and validating OpenAI request bodies into typed requests.

Everything a client sends is checked here, before a token goes down the
chain: a wrong type, a value out of range or an unsupported option is a 400
naming the parameter, as OpenAI answers it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import OpenAIError, invalid
from .limits import shown
from .sampling import SamplingParams

__all__ = ["ChatRequest", "CompletionRequest", "GenerationOptions", "parse_json_object"]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
# Characters of one stop sequence: the stop filter holds back up to this much
# text and matches prefixes of it on every token, on the event loop.
MAX_STOP_CHARS = 512
MAX_SEED = 2**64 - 1  # numpy's default_rng takes any non-negative int; bound it anyway


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationOptions:
    model: str
    max_tokens: int | None  # None: the gateway's default, capped by the context
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    # The sampling parameters the request named; the others may come from the
    # checkpoint's generation_config.json (defaults.py).
    explicit: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    options: GenerationOptions
    prompt: str | list[int]  # text, or token ids as given


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    options: GenerationOptions
    messages: list[dict[str, Any]]


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):  # an integer of > 4300 digits is one too
        raise OpenAIError(
            "We could not parse the JSON body of your request: it is not valid JSON."
        ) from None
    except RecursionError:  # "[" x 200,000: deeper than the parser recurses
        raise OpenAIError(
            "We could not parse the JSON body of your request: it is nested too deeply."
        ) from None
    if not isinstance(document, dict):
        raise OpenAIError("The request body must be a JSON object.")
    return document


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(document: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = document.get(name)
    if value is None:
        return default
    # An int is compared as is: math.isfinite would convert it to a float,
    # and a 4,000-digit integer (valid JSON) overflows that conversion.
    if not (_is_int(value) or (isinstance(value, float) and math.isfinite(value))):
        raise invalid(name, f"{shown(value)} is not of type 'number' - '{name}'", "invalid_type")
    if not low <= value <= high:
        raise invalid(name, f"{name} must be between {low} and {high}, got {shown(value)}",
                      "invalid_value")  # fmt: skip
    return float(value)


def _integer(document: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = document.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(name, f"{shown(value)} is not of type 'integer' - '{name}'", "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise invalid(name, f"{name} must be {bound}, got {shown(value)}", "invalid_value")
    return value


def _bool(document: dict[str, Any], name: str) -> bool:
    value = document.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"{shown(value)} is not of type 'boolean' - '{name}'", "invalid_type")
    return value


def _options(document: dict[str, Any], *, max_tokens_names: tuple[str, ...]) -> GenerationOptions:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "you must provide a model parameter (a string)", "invalid_type")
    max_tokens = None
    for name in max_tokens_names:
        value = _integer(document, name, 0)
        if value is not None:
            max_tokens = value
    n = _integer(document, "n", 1)
    if n is not None and n != 1:
        raise invalid("n", "only n=1 is supported", "unsupported_value")
    stop = document.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences", "invalid_value")
        stops = tuple(stop)
    else:
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid("stop", f"a stop sequence may have at most {MAX_STOP_CHARS} characters",
                      "invalid_value")  # fmt: skip
    if document.get("logprobs") not in (None, False, 0):
        raise invalid("logprobs", "logprobs are not supported", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(document, name, 0.0, -2.0, 2.0) != 0.0:
            raise invalid(name, f"{name} is not supported (only 0)", "unsupported_parameter")
    if document.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias", "logit_bias is not supported", "unsupported_parameter")
    if _bool(document, "echo"):
        raise invalid("echo", "echo is not supported", "unsupported_parameter")
    stream = _bool(document, "stream")
    stream_options = document.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options", "stream_options must be an object", "invalid_type")
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        include_usage = _bool(stream_options, "include_usage")
    sampling = SamplingParams(
        temperature=_number(document, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(document, "top_p", 1.0, 0.0, 1.0) or 1.0,  # 0 means "no cut" here
        top_k=_integer(document, "top_k", 0) or 0,
    )
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        seed=_integer(document, "seed", 0, MAX_SEED),
        stop=stops,
        stream=stream,
        include_usage=include_usage,
        explicit=frozenset(
            n for n in ("temperature", "top_p", "top_k") if document.get(n) is not None
        ),
    )


def parse_completion(document: dict[str, Any]) -> CompletionRequest:
    options = _options(document, max_tokens_names=("max_tokens",))
    prompt = document.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return CompletionRequest(options=options, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return CompletionRequest(options=options, prompt=list(prompt))
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("prompt", "only one prompt per request is supported", "unsupported_value")
    raise invalid("prompt", "prompt must be a string or a list of token ids", "invalid_type")


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"messages.[{index}].content",
                              "only text content parts are supported", "invalid_type")  # fmt: skip
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"messages.[{index}].content", "a text part needs 'text'",
                              "invalid_type")  # fmt: skip
            parts.append(text)
        return "".join(parts)
    raise invalid(f"messages.[{index}].content", "content must be a string or text parts",
                  "invalid_type")  # fmt: skip


def parse_chat(document: dict[str, Any]) -> ChatRequest:
    options = _options(document, max_tokens_names=("max_tokens", "max_completion_tokens"))
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list", "invalid_type")
    checked: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages.[{index}]", "each message must be an object", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages.[{index}].role", "a message needs a role", "invalid_type")
        checked.append({"role": role, "content": _content_text(message.get("content"), index)})
    return ChatRequest(options=options, messages=checked)

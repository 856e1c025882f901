"""Parsing and validating OpenAI request bodies into typed requests.

Everything a client sends is checked here, before a token goes down the
chain: a wrong type, a value out of range or an unsupported option is a 400
naming the parameter, as OpenAI answers it.

A field this module does not know is ignored, as OpenAI's own server and
vLLM ignore one (clients add fields of their own). But a field of OpenAI's
API, or a common vLLM/llama.cpp extension, that asks for something this
gateway does not do (beam search, audio, …) is refused by
name (``REFUSED``) — never accepted and silently ignored. The table in
docs/openai-api.md lists every field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from meshnet_model.sampling import REPETITION_PENALTY, SamplingParams

from .errors import OpenAIError, invalid
from .limits import PromptLimits, checked_text, shown
from .messages import checked_message
from .schemas import response_schema
from .tools import Tools, parse_tools

__all__ = ["ChatRequest", "CompletionRequest", "GenerationOptions", "parse_json_object"]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
# Characters of one stop sequence: the stop filter holds back up to this much
# text and matches prefixes of it on every token, on the event loop.
MAX_STOP_CHARS = 512
MAX_SEED = 2**64 - 1  # numpy's default_rng takes any non-negative int; bound it anyway
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_LOGIT_BIAS = 300  # OpenAI's limit on entries
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32
MAX_MIN_TOKENS = 2**31 - 1
# Choices of one request (n): each is a generation on the chain, admitted as
# one request; vLLM sets no bound, OpenAI 128. A few cover what clients ask.
MAX_CHOICES = 16

# Known fields refused unless absent, null or one of the values that ask for
# nothing (the values listed): name -> (neutral values, why refused).
REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "functions": ((), "functions (deprecated) are not supported: use tools"),
    "function_call": ((), "function_call (deprecated) is not supported: use tool_choice"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "echo": ((False,), "echo is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "stored completions are not supported"),
    "service_tier": (("auto", "default"), "only the default service tier exists"),
    # vLLM's extensions
    "prompt_logprobs": ((), "prompt_logprobs is not supported"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty (beam search) is not supported"),
    "include_stop_str_in_output": ((False,), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": ((True,), "only skip_special_tokens=true is supported"),
    "spaces_between_special_tokens": ((True,), "only the default is supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported"),
    "bad_words": (([],), "bad_words is not supported"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported"),
    "guided_json": ((), "use response_format (json_object or json_schema)"),
    "guided_regex": ((), "use response_format (json_object or json_schema)"),
    "guided_choice": ((), "use response_format (json_object or json_schema)"),
    "guided_grammar": ((), "use response_format (json_object or json_schema)"),
    "structured_outputs": ((), "use response_format (json_object or json_schema)"),
    "typical_p": ((1, 1.0), "typical_p is not supported"),
    "chat_template": ((), "the checkpoint's chat template is the only one"),
    "chat_template_kwargs": (({},), "chat_template_kwargs is not supported"),
    "add_generation_prompt": ((True,), "the generation prompt is always added"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "documents": ((), "documents are not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    # llama.cpp's names for what is here under vLLM's names
    "repeat_penalty": ((), "use repetition_penalty"),
    "n_probs": ((), "use logprobs / top_logprobs"),
    "grammar": ((), "grammars are not supported: use response_format"),
    "json_schema": ((), "use response_format (json_schema)"),
}


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
    # vLLM's per-request prefix-cache salt: a cached prefix is shared only
    # with requests of the same tenant that give the same salt (§3.15).
    cache_salt: str | None = None
    n: int = 1  # choices to generate (choices.py)
    # The JSON schema the answer must validate against (response_format).
    schema: dict[str, Any] | bool | None = None
    tools: Tools | None = None  # chat only

    def check_vocab(self, vocab: int) -> None:
        """Token ids the request names (logit_bias, stop_token_ids) must exist."""
        for name, ids in (
            ("logit_bias", [i for i, _ in self.sampling.logit_bias]),
            ("stop_token_ids", self.sampling.stop_token_ids),
        ):
            if any(i >= vocab for i in ids):
                raise invalid(name, f"{name}: token ids must be in [0, {vocab})", "invalid_value")


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
        raise invalid(
            name, f"{name} must be between {low} and {high}, got {shown(value)}", "invalid_value"
        )
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
    return int(value)


def _bool(document: dict[str, Any], name: str) -> bool:
    value = document.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"{shown(value)} is not of type 'boolean' - '{name}'", "invalid_type")
    return value


def _options(
    document: dict[str, Any], *, max_tokens_names: tuple[str, ...], logprobs: int | None
) -> GenerationOptions:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "you must provide a model parameter (a string)", "invalid_type")
    max_tokens = None
    for name in max_tokens_names:
        value = _integer(document, name, 0)
        if value is not None:
            max_tokens = value
    n = _integer(document, "n", 1, MAX_CHOICES) or 1
    stops = _stops(document.get("stop"))
    _refused(document)
    if _integer(document, "best_of", 1) not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported", "unsupported_value")
    stream = _bool(document, "stream")
    include_usage = _include_usage(document.get("stream_options"), stream)
    min_tokens = _integer(document, "min_tokens", 0, MAX_MIN_TOKENS) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(
            "min_tokens",
            f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})",
            "invalid_value",
        )
    schema = response_schema(document.get("response_format"))
    if schema is not None and (min_tokens or _bool(document, "ignore_eos")):
        # The grammar ends the answer where the schema does: nothing may
        # hold back (min_tokens) or run past (ignore_eos) that end.
        why = "response_format cannot be combined with min_tokens or ignore_eos"
        raise invalid("response_format", why, "invalid_value")
    repetition = _number(document, "repetition_penalty", 1.0, *REPETITION_PENALTY)
    sampling = SamplingParams(
        temperature=_number(document, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(document, "top_p", 1.0, 0.0, 1.0) or 1.0,  # 0 means "no cut" here
        top_k=_integer(document, "top_k", 0) or 0,
        min_p=_number(document, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=repetition,
        presence_penalty=_number(document, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(document, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(document.get("logit_bias")),
        min_tokens=min_tokens,
        ignore_eos=_bool(document, "ignore_eos"),
        stop_token_ids=_stop_token_ids(document.get("stop_token_ids")),
        logprobs=logprobs,
    )
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        seed=_integer(document, "seed", 0, MAX_SEED),
        stop=stops,
        stream=stream,
        include_usage=include_usage,
        explicit=frozenset(n for n in DEFAULTED if document.get(n) is not None),
        cache_salt=_cache_salt(document.get("cache_salt")),
        n=n,
        schema=schema,
    )


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops: tuple[str, ...] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences", "invalid_value")
        stops = tuple(stop)
    else:
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        why = f"a stop sequence may have at most {MAX_STOP_CHARS} characters"
        raise invalid("stop", why, "invalid_value")
    return stops


def _include_usage(stream_options: Any, stream: bool) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise invalid("stream_options", "stream_options must be an object", "invalid_type")
    if not stream:
        why = "stream_options is only allowed with stream: true"
        raise invalid("stream_options", why, "invalid_value")
    return _bool(stream_options, "include_usage")


def _cache_salt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid("cache_salt", "cache_salt must be a string", "invalid_type")
    if not 0 < len(value) <= MAX_CACHE_SALT:
        raise invalid(
            "cache_salt", f"cache_salt: 1 to {MAX_CACHE_SALT} characters", "invalid_value"
        )
    return checked_text("cache_salt", value)  # it is hashed as UTF-8


# A cache_salt is hashed, never stored: its length only bounds the hashing.
MAX_CACHE_SALT = 256

# The sampling parameters generation_config.json may give a default for.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _refused(document: dict[str, Any]) -> None:
    for name, (neutral, why) in REFUSED.items():
        value = document.get(name)
        if value is None or any(type(value) is type(n) and value == n for n in neutral):
            continue
        raise invalid(name, f"{name}: {why}", "unsupported_parameter")


def _token_id(name: str, value: Any) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10:
        value = int(value)  # logit_bias keys are JSON strings
    if not _is_int(value):
        raise invalid(name, f"{name}: {shown(value)} is not a token id", "invalid_type")
    if not 0 <= value <= MAX_TOKEN_ID:
        raise invalid(name, f"{name}: token id {shown(value)} is out of range", "invalid_value")
    return int(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", "logit_bias must be an object", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries", "invalid_value")
    pairs = {}
    for key, bias in value.items():
        token = _token_id("logit_bias", key)
        if bias is None:
            raise invalid("logit_bias", "a logit_bias value must be a number", "invalid_type")
        pairs[token] = _number({"logit_bias": bias}, "logit_bias", 0.0, -100.0, 100.0)
    return tuple(sorted(pairs.items()))


def _stop_token_ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list):
        raise invalid(
            "stop_token_ids", "stop_token_ids must be a list of token ids", "invalid_type"
        )
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "invalid_value"
        )
    return frozenset(_token_id("stop_token_ids", v) for v in value)


def _completion_logprobs(document: dict[str, Any]) -> int | None:
    if document.get("top_logprobs") is not None:
        raise invalid(
            "top_logprobs",
            "top_logprobs is a chat field; completions take logprobs: N",
            "unsupported_parameter",
        )
    return _integer(document, "logprobs", 0, MAX_COMPLETION_LOGPROBS)


def _chat_logprobs(document: dict[str, Any]) -> int | None:
    wanted = _bool(document, "logprobs")
    top = _integer(document, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true", "invalid_value")
    return (top or 0) if wanted else None


def parse_completion(document: dict[str, Any]) -> CompletionRequest:
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if document.get(name) is not None:
            why = f"{name}: tools are a chat field (/v1/chat/completions)"
            raise invalid(name, why, "unsupported_parameter")
    options = _options(
        document, max_tokens_names=("max_tokens",), logprobs=_completion_logprobs(document)
    )
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


def parse_chat(document: dict[str, Any], limits: PromptLimits | None = None) -> ChatRequest:
    """``limits``: their message count is checked before any message is (issue 37)."""
    options = _options(
        document,
        max_tokens_names=("max_tokens", "max_completion_tokens"),
        logprobs=_chat_logprobs(document),
    )
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list", "invalid_type")
    if limits is not None:
        limits.check_messages(messages)
    checked = [checked_message(message, index) for index, message in enumerate(messages)]
    tools = parse_tools(document)
    if tools is not None:
        _check_with_tools(tools, options)
        options = replace(options, tools=tools)
    return ChatRequest(options=options, messages=checked)


def _check_with_tools(tools: Tools, options: GenerationOptions) -> None:
    """What a tool conversation cannot be asked together with."""
    if not tools.offered:
        return
    if options.sampling.logprobs is not None:
        # A call's text is not streamed as content: its tokens have no chunk
        # to carry their logprobs.
        raise invalid(
            "logprobs",
            "logprobs with tools is not supported (tool_choice 'none' allows it)",
            "unsupported_parameter",
        )
    if tools.forced and (options.sampling.min_tokens or options.sampling.ignore_eos):
        why = "a forced tool call cannot be combined with min_tokens or ignore_eos"
        raise invalid("tool_choice", why, "invalid_value")
    if tools.forced and options.schema is not None:
        why = "response_format applies to a text answer; tool_choice forces a tool call"
        raise invalid("response_format", why, "invalid_value")

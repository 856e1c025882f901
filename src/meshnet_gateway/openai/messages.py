"""A chat request's messages, checked: role, content, and a participant's
``name``.

No field of a message is silently dropped. ``name`` (OpenAI: letters,
digits, ``_`` and ``-``, at most 64) reaches the chat template, which is
where a model learns who speaks; a template that never writes it (most do
not, SmolLM2's among them) would drop it without a word, so then it is
refused by name (``check_names``), the client told to fold it into the
content instead. An assistant's ``tool_calls`` and a ``tool`` message's
``tool_call_id`` are checked and kept for the template (tool_prompt.py);
the fields of the deprecated function calling and of audio are refused by
name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .errors import OpenAIError, invalid
from .tokenizer import ChatTemplateError, ModelTokenizer

__all__ = ["check_names", "checked_message"]

# OpenAI's rule for a participant's name; nothing in it can be a special
# token's text, so a name cannot forge a turn whatever the policy.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Fields of a message asking for what is not done here: name -> why.
_REFUSED = {
    "function_call": "function calling is not supported",
    "audio": "audio is not supported",
}
_PROBE = "meshnetNameProbe"


def checked_message(message: Any, index: int) -> dict[str, Any]:
    """One message as the template gets it: role, content as text, and the
    name when given."""
    where = f"messages.[{index}]"
    if not isinstance(message, dict):
        raise invalid(where, "each message must be an object", "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise invalid(f"{where}.role", "a message needs a role", "invalid_type")
    for field, why in _REFUSED.items():
        if message.get(field) is not None:
            raise invalid(f"{where}.{field}", f"{field}: {why}", "unsupported_parameter")
    calls = message.get("tool_calls")
    content = message.get("content")
    if calls is not None and role != "assistant":
        raise invalid(
            f"{where}.tool_calls", "only an assistant message has tool_calls", "invalid_value"
        )
    text = "" if content is None and calls is not None else _content_text(content, where)
    checked: dict[str, Any] = {"role": role, "content": text}
    if calls is not None:
        checked["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
            why = "a tool message needs the tool_call_id it answers (a string)"
            raise invalid(f"{where}.tool_call_id", why, "invalid_type")
        checked["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            why = "a name is 1 to 64 letters, digits, '_' or '-'"
            raise invalid(f"{where}.name", why, "invalid_value")
        checked["name"] = name
    return checked


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's past calls, their arguments parsed (templates write
    them as JSON objects)."""
    if not isinstance(calls, list) or not calls:
        raise invalid(where, "tool_calls must be a non-empty array", "invalid_type")
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}.[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                at,
                "a tool call is {'id', 'type': 'function', 'function': {'name', 'arguments'}}",
                "invalid_type",
            )
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            why = "a tool call's arguments must be a JSON object, as a string"
            raise invalid(f"{at}.function.arguments", why, "invalid_value")
        call_id = call.get("id")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
        checked.append(entry if not isinstance(call_id, str) else {"id": call_id, **entry})
    return checked


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                why = "only text content parts are supported"
                raise invalid(f"{where}.content", why, "invalid_type")
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.content", "a text part needs 'text'", "invalid_type")
            parts.append(text)
        return "".join(parts)
    raise invalid(f"{where}.content", "content must be a string or text parts", "invalid_type")


def check_names(tokenizer: ModelTokenizer, messages: Sequence[dict[str, Any]]) -> None:
    """A 400 naming the first message whose ``name`` the template would drop."""
    named = next((i for i, m in enumerate(messages) if "name" in m), None)
    if named is None or _writes_names(tokenizer):
        return
    raise OpenAIError(
        "this model's chat template does not write a message's name, so it would be "
        "ignored; put who speaks in the content instead",
        param=f"messages.[{named}].name",
        code="unsupported_parameter",
    )


def _writes_names(tokenizer: ModelTokenizer) -> bool:
    """Whether the template writes a user message's name: rendered once per
    template with a name no template could hold by chance."""
    template = tokenizer.chat_template
    known = _WRITES_NAMES.get(template)
    if known is None:
        try:
            text = tokenizer.render_chat([{"role": "user", "content": "hi", "name": _PROBE}])
        except ChatTemplateError:
            text = ""
        known = _WRITES_NAMES[template] = _PROBE in text
    return known


# Per template (a gateway serves one): whether it writes names.
_WRITES_NAMES: dict[str, bool] = {}

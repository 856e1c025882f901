"""A conversation with tools, as the chat template gets it.

A template that writes the ``tools`` it is given (Qwen, Llama 3.1, Hermes,
…) gets them as Hugging Face passes them, with the assistant's past
``tool_calls`` and the ``tool`` messages as they are; its syntax is read
from the template's text. A template that knows no tools (SmolLM2's among
them: rendered with and without tools, its prompt is the same) would drop
them without a word, so meshnet writes them itself in the ``hermes`` syntax:
a system message that lists the functions and shows how to call one, each
past call as its block in the assistant's text, each tool result as a user
turn in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .errors import invalid
from .special_tokens import ChatEncoder
from .tokenizer import ChatTemplateError, ModelTokenizer
from .tool_syntax import HERMES, LLAMA3, ToolSyntax
from .tools import Tool, Tools

__all__ = ["ToolPrompt"]

_PROBE = Tool("meshnet_probe_function", None, {"type": "object"})


class ToolPrompt:
    """Tool conversations for one served model's template."""

    def __init__(self, encoder: ChatEncoder) -> None:
        self.encoder = encoder
        tokenizer = encoder.tokenizer
        self.native = _writes_tools(tokenizer)
        self.syntax = _syntax(tokenizer.chat_template) if self.native else HERMES

    def encode(self, messages: list[dict[str, Any]], tools: Tools | None) -> list[int]:
        """The ids of the conversation, its tools written the template's way."""
        offered = tools.tools if tools is not None and tools.offered else ()
        has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if not offered and not has_calls:
            return self.encoder.encode(messages)
        if self.native:
            self._check_special(messages, offered)
            listed = [t.for_template() for t in offered] or None
            return self.encoder.encode(messages, tools=listed)
        return self.encoder.encode(self._written(messages, offered))

    def _check_special(self, messages: list[dict[str, Any]], tools: Sequence[Tool]) -> None:
        # The template writes these itself: a special token in them would
        # forge a turn, whatever the content policy escapes.
        if self.encoder.policy == "keep":
            return
        texts = [json.dumps([t.for_template() for t in tools])]
        texts += [json.dumps(m["tool_calls"]) for m in messages if m.get("tool_calls")]
        for text in texts:
            token = self.encoder.find_special(text)
            if token is not None:
                why = f"a special token ({token!r}) in tools or tool_calls is refused"
                raise invalid("tools", why, "special_token_in_content")

    def _written(
        self, messages: list[dict[str, Any]], tools: Sequence[Tool]
    ) -> list[dict[str, Any]]:
        written = [_plain(message) for message in messages]
        if not tools:
            return written
        listing = _listing(tools)
        if written and written[0]["role"] == "system":
            first = written[0]
            return [{**first, "content": f"{first['content']}\n\n{listing}"}, *written[1:]]
        return [{"role": "system", "content": listing}, *written]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message of a tool conversation in text the template writes as any."""
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [HERMES.call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    text = "\n".join(filter(None, [message["content"], *blocks]))
    return {"role": message["role"], "content": text}


def _listing(tools: Sequence[Tool]) -> str:
    lines = "\n".join(json.dumps(t.for_template(), ensure_ascii=False) for t in tools)
    example = HERMES.call_text("<function-name>", {"<argument>": "<value>"})
    return (
        "You may call functions to answer. They are, as JSON schemas:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, answer with one block per call, its arguments a JSON object:\n"
        f"{example}"
    )


def _writes_tools(tokenizer: ModelTokenizer) -> bool:
    """Whether the template writes the tools it is given: rendered once with
    a probe function and once without."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.render_chat(messages)
        with_tools = tokenizer.render_chat(messages, tools=[_PROBE.for_template()])
    except ChatTemplateError:
        return False
    return plain != with_tools and _PROBE.name in with_tools


def _syntax(template: str) -> ToolSyntax:
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES

"""How a model writes a tool call, per chat-template family: the text of a
call (to put past calls back into a prompt), the grammar that forces one,
and the parser that finds the calls in an answer.

* ``hermes`` (Qwen 2/2.5/3, Hermes, and meshnet's own prompt for templates
  that know no tools): ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``,
  one block per call, several in a row for parallel calls.
* ``llama3`` (Llama 3.1+ JSON tool calling): the answer is one JSON object
  ``{"name": …, "parameters": {…}}``; one call per answer.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .tools import Tool

__all__ = ["HERMES", "LLAMA3", "ToolCall", "ToolSyntax", "new_call_id"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# Compact JSON inside a forced call (see grammar.py: a small model given free
# whitespace may fill max_tokens with blank lines).
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ToolSyntax:
    name = ""
    open_tag = ""  # what starts a call in the answer's text
    close_tag = ""  # what ends one (none: the call is the whole answer)

    def call_text(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
        """The answer's text outside the calls (None when nothing is left)
        and its calls; no calls when any part that looks like one does not
        parse as a call of a known function (the whole answer is then text)."""
        raise NotImplementedError


def _call_schema(tool: Tool, arguments_key: str) -> dict[str, Any]:
    # The parameters are a schema of their own inside the call's: an $id makes
    # their "#/$defs/…" (and "#") refs resolve against them, not the call.
    parameters = tool.parameters
    if isinstance(parameters, dict) and "$id" not in parameters:
        parameters = {"$id": f"urn:meshnet:tool:{tool.name}", **parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _json_rule(schemas: list[dict[str, Any]]) -> str:
    schema = {"anyOf": schemas, "x-guidance": _COMPACT}
    return "%json " + json.dumps(schema)


def _arguments(value: Any) -> str | None:
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


class _Hermes(ToolSyntax):
    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def call_text(self, name: str, arguments: Any) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        rule = _json_rule([_call_schema(t, "arguments") for t in tools])
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: {rule}\n'

    def parse(self, text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
        blocks = list(self._BLOCK.finditer(text))
        calls = []
        for block in blocks:
            call = _decoded(block.group(1), names, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        rest = self._BLOCK.sub("", text).strip()
        return rest or None, calls


class _Llama3(ToolSyntax):
    name = "llama3"
    open_tag = "{"

    def call_text(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        return f"start: body\nbody: {_json_rule([_call_schema(t, 'parameters') for t in tools])}\n"

    def parse(self, text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped.removeprefix("<|python_tag|>").strip()
        call = _decoded(stripped, names, "parameters") if stripped.startswith("{") else None
        return (text, []) if call is None else (None, [call])


def _decoded(body: str, names: Sequence[str], arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    # Models of either family write the other key now and then.
    raw = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    arguments = _arguments(raw)
    if arguments is None:
        return None
    return ToolCall(new_call_id(), value["name"], arguments)


HERMES: ToolSyntax = _Hermes()
LLAMA3: ToolSyntax = _Llama3()

"""Tool calling: a request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, checked, and what they ask of the generation.

The model writes a call in its chat template's syntax (``syntax.py``); with
``tool_choice`` ``required`` or a named function the generation is held to
that syntax and to each function's ``parameters`` schema by a grammar
(grammar.py), so the arguments always parse and validate; with ``auto`` the
model may answer in text or call, and its output is parsed afterwards (a
call that does not parse stays text, as vLLM leaves it); ``none`` renders
no tools and parses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .errors import invalid
from .schemas import NAME, checked_schema

__all__ = ["MAX_TOOLS", "Tool", "ToolChoice", "Tools", "parse_tools"]

MAX_TOOLS = 128  # OpenAI's limit

ToolChoice = Literal["none", "auto", "required"] | str  # or a function's name


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | bool  # a JSON schema; {} takes any object

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates receive it (HF's ``tools`` argument)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Tools:
    tools: tuple[Tool, ...]
    # "none", "auto", "required", or the name of the function to call.
    choice: str
    parallel: bool

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools the answer must call one of (empty: the model chooses)."""
        if self.choice == "required":
            return self.tools
        if self.choice in ("none", "auto"):
            return ()
        return tuple(t for t in self.tools if t.name == self.choice)

    @property
    def offered(self) -> bool:
        """Whether the model is told of the tools and its output parsed."""
        return self.choice != "none"


def parse_tools(document: dict[str, Any]) -> Tools | None:
    """The request's tools, or None when it has none (``tool_choice`` and
    ``parallel_tool_calls`` then ask for nothing)."""
    raw = document.get("tools")
    choice = document.get("tool_choice")
    parallel = document.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(
            "parallel_tool_calls", "parallel_tool_calls must be a boolean", "invalid_type"
        )
    if raw is None or raw == []:
        if choice not in (None, "none"):
            why = "tool_choice is only allowed when tools are given"
            raise invalid("tool_choice", why, "invalid_value")
        return None
    if not isinstance(raw, list):
        raise invalid("tools", "tools must be an array", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools", "invalid_value")
    tools = tuple(_tool(entry, f"tools.[{i}]") for i, entry in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools", "tools: each function needs its own name", "invalid_value")
    return Tools(tools, _choice(choice, names), parallel is not False)


def _tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise invalid(
            where, f"{where}: a tool is {{'type': 'function', 'function': {{…}}}}", "invalid_type"
        )
    function = entry.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "a tool needs its function", "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        why = "a function's name is 1 to 64 letters, digits, '_' or '-'"
        raise invalid(f"{where}.function.name", why, "invalid_value")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        why = "a function's description must be a string"
        raise invalid(f"{where}.function.description", why, "invalid_type")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.function.strict", "strict must be a boolean", "invalid_type")
    parameters = function.get("parameters", {"type": "object"})
    checked = checked_schema(parameters, f"{where}.function.parameters")
    return Tool(name, description, checked)


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        return str(value)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name in names:
            return name
        raise invalid(
            "tool_choice", "tool_choice names a function that is not in tools", "invalid_value"
        )
    why = (
        "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': …}}"
    )
    raise invalid("tool_choice", why, "invalid_value")

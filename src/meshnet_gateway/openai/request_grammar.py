"""The grammar a request's answer is held to, if any: a forced tool call's
(``tool_choice`` ``required`` or a named function) or ``response_format``'s
schema; built and checked in the request's worker thread, before admission."""

from __future__ import annotations

from .grammar import Grammar, GrammarCompiler
from .requests import GenerationOptions
from .tool_syntax import ToolSyntax

__all__ = ["request_grammar"]


def request_grammar(
    compiler: GrammarCompiler, syntax: ToolSyntax, options: GenerationOptions
) -> Grammar | None:
    """None for an answer in free text; a 400 naming the parameter for a
    schema the grammar library refuses or cannot start from."""
    tools = options.tools
    if tools is not None and tools.forced:
        # Each function's parameters on their own first: a problem is named
        # by its tool, and one that shows only once the grammar runs (a $ref
        # loop) is found at its first step, as response_format's is.
        for index, tool in enumerate(tools.tools):
            if tool in tools.forced:
                compiler.json_schema(tool.parameters, f"tools.[{index}].function.parameters")
        return compiler.lark(syntax.grammar(tools.forced, tools.parallel), "tools")
    if options.schema is not None:
        return compiler.json_schema(options.schema, "response_format")
    return None

"""A choice's answer when tools are offered: its text split into content
and tool calls, the same way whether it is streamed or whole.

The rule: each complete call block that parses as a call of a known
function becomes a tool call; everything else is content, stripped of
leading and trailing whitespace. Streamed, content goes out as it comes,
except what may be the start of a call (held until it is one or is not) and
whitespace that may turn out to be trailing; a call goes out as one
``tool_calls`` delta when its block closes. So the deltas of a stream
reassemble to the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tool_syntax import LLAMA3, ToolCall, ToolSyntax

__all__ = ["ToolOutput", "split_answer"]


def split_answer(
    text: str, syntax: ToolSyntax, names: Sequence[str]
) -> tuple[str | None, list[ToolCall]]:
    """The whole answer's content (None when empty) and its calls."""
    stream = ToolOutput(syntax, names)
    pieces = [stream.push(text), stream.flush()]
    content = "".join(c for part in pieces for c, _ in part if c)
    calls = [call for part in pieces for _, call in part if call is not None]
    return content or None, calls


# One output of the filter: (content, None) or ("", call).
Piece = tuple[str, ToolCall | None]


class ToolOutput:
    """The streaming split of one choice's text."""

    def __init__(self, syntax: ToolSyntax, names: Sequence[str]) -> None:
        self.syntax = syntax
        self.names = list(names)
        self.calls = 0
        self._buffer = ""
        self._inside = False  # the buffer starts with an open call block
        self._started = False  # some content went out (leading space is gone)
        self._space = ""  # whitespace held: trailing unless content follows
        self._whole = syntax is LLAMA3  # the answer is one JSON call, or text

    def push(self, piece: str) -> list[Piece]:
        self._buffer += piece
        if self._whole:
            return self._whole_push()
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self._buffer.find(self.syntax.close_tag)
                if end < 0:
                    return out
                end += len(self.syntax.close_tag)
                block, self._buffer = self._buffer[:end], self._buffer[end:]
                self._inside = False
                out += self._block(block)
                continue
            start = self._buffer.find(self.syntax.open_tag)
            if start >= 0:
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._inside = True
                continue
            keep = _partial_tag(self._buffer, self.syntax.open_tag)
            text = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(text) :]
            return out + self._content(text)

    def flush(self) -> list[Piece]:
        """The end of the answer: what was held is content (an unclosed
        block included), its trailing whitespace dropped."""
        text, self._buffer = self._buffer, ""
        if self._whole and self._inside:
            _, calls = self.syntax.parse(text, self.names)
            if calls:
                self.calls += len(calls)
                return [("", call) for call in calls]
        return self._content(text.rstrip(), final=True)

    def _whole_push(self) -> list[Piece]:
        # Llama 3's call is the whole answer: held from its first "{" to the end.
        if self._inside:
            return []
        stripped = self._buffer.lstrip()
        if not stripped:
            return []
        if stripped.startswith(self.syntax.open_tag):
            self._inside = True
            return []
        self._whole = False  # plain text: stream it as any
        text, self._buffer = self._buffer, ""
        return self._content(text)

    def _block(self, block: str) -> list[Piece]:
        _, calls = self.syntax.parse(block, self.names)
        if not calls:
            return self._content(block)
        self.calls += len(calls)
        return [("", call) for call in calls]

    def _content(self, text: str, *, final: bool = False) -> list[Piece]:
        if not self._started:
            text = text.lstrip()
        if not text:
            return []
        body = text.rstrip()
        if not body:
            if not final:
                self._space += text
            return []
        out = self._space + body
        self._space = "" if final else text[len(body) :]
        self._started = True
        return [(out, None)]


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0

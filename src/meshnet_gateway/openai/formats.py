"""The JSON documents of the OpenAI endpoints: a whole answer and the
chunks of its stream, one ``Format`` per endpoint (completions, chat).

A request with ``n`` > 1 has one choice per generation, each with its
``index``: a whole answer lists them in order, a stream's chunks name the
choice they belong to, and the usage counts the prompt once and every
choice's tokens (as OpenAI counts them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from .generation import GenerationResult
from .logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from .tool_output import ToolOutput, split_answer
from .tool_syntax import ToolSyntax

__all__ = ["ChatFormat", "CompletionFormat", "Format", "usage"]


def usage(results: Sequence[GenerationResult]) -> dict[str, int]:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(result.completion_tokens for result in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Format:
    """The JSON shapes of one endpoint: a whole answer and its stream chunks."""

    endpoint = ""  # the metrics label
    object_whole = ""
    object_chunk = ""
    prefix = ""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        choices = [self.choice(result, index) for index, result in enumerate(results)]
        return {**self._envelope(self.object_whole, choices), "usage": usage(results)}

    def choice(self, result: GenerationResult, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        return None

    def chunk(
        self, piece: str, logprobs: list[TokenLogprob] | None, index: int = 0
    ) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(
        self, piece: str, logprobs: list[TokenLogprob] | None, index: int = 0
    ) -> list[dict[str, Any]]:
        """The chunks a piece of text makes (tool calls may hold it back)."""
        return [self.chunk(piece, logprobs, index)]

    def last_chunk(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def last_chunks(self, result: GenerationResult, index: int = 0) -> list[dict[str, Any]]:
        """A choice's closing chunks: what was held back, then its last one."""
        return [self.last_chunk(result, index)]

    def usage_chunk(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk, []), "usage": usage(results)}


class CompletionFormat(Format):
    endpoint = "completions"
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._offsets: dict[int, int] = {}  # per choice: text_offset of its next streamed token

    def choice(self, result: GenerationResult, index: int) -> dict[str, Any]:
        logprobs = None if result.logprobs is None else completion_logprobs(result.logprobs)
        return {
            "text": result.text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
        }

    def chunk(
        self, piece: str, logprobs: list[TokenLogprob] | None, index: int = 0
    ) -> dict[str, Any]:
        shaped = None
        if logprobs is not None:
            offset = self._offsets.get(index, 0)
            shaped = completion_logprobs(logprobs, offset)
            self._offsets[index] = offset + sum(len(e.token.text) for e in logprobs)
        choice = {"text": piece, "index": index, "logprobs": shaped, "finish_reason": None}
        return self._envelope(self.object_chunk, [choice])

    def last_chunk(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        choice = {
            "text": "",
            "index": index,
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
        return self._envelope(self.object_chunk, [choice])


class ChatFormat(Format):
    endpoint = "chat"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(
        self, model: str, syntax: ToolSyntax | None = None, tool_names: tuple[str, ...] = ()
    ) -> None:
        """``syntax``: the answer may hold tool calls of ``tool_names`` in it."""
        super().__init__(model)
        self.syntax = syntax
        self.tool_names = tool_names
        self._tool_outputs: dict[int, ToolOutput] = {}  # per streamed choice
        self._call_numbers: dict[int, int] = {}  # per streamed choice: calls sent

    def choice(self, result: GenerationResult, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish = result.finish_reason
        if self.syntax is not None:
            content, calls = split_answer(result.text, self.syntax, self.tool_names)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
                finish = _tool_finish(finish)
        return {
            "index": index,
            "message": message,
            "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
            "finish_reason": finish,
        }

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def chunk(
        self, piece: str, logprobs: list[TokenLogprob] | None, index: int = 0
    ) -> dict[str, Any]:
        shaped = None if logprobs is None else chat_logprobs(logprobs)
        return self._delta({"content": piece}, index, logprobs=shaped)

    def chunks(
        self, piece: str, logprobs: list[TokenLogprob] | None, index: int = 0
    ) -> list[dict[str, Any]]:
        if self.syntax is None:
            return [self.chunk(piece, logprobs, index)]
        return self._split(index, self._output(index).push(piece))

    def last_chunk(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        finish = result.finish_reason
        output = self._tool_outputs.get(index)
        if output is not None and output.calls:
            finish = _tool_finish(finish)
        return self._delta({}, index, finish=finish)

    def last_chunks(self, result: GenerationResult, index: int = 0) -> list[dict[str, Any]]:
        held = [] if self.syntax is None else self._split(index, self._output(index).flush())
        return [*held, self.last_chunk(result, index)]

    def _output(self, index: int) -> ToolOutput:
        output = self._tool_outputs.get(index)
        if output is None:
            assert self.syntax is not None
            output = self._tool_outputs[index] = ToolOutput(self.syntax, self.tool_names)
        return output

    def _split(self, index: int, pieces: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        chunks = []
        for text, call in pieces:
            if call is None:
                chunks.append(self._delta({"content": text}, index))
            else:
                # The official client accumulates calls by their index.
                number = self._call_numbers.get(index, 0)
                self._call_numbers[index] = number + 1
                chunks.append(self._delta({"tool_calls": [call.openai(number)]}, index))
        return chunks

    def _delta(
        self,
        delta: dict[str, Any],
        index: int,
        *,
        logprobs: Any = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope(self.object_chunk, [choice])


def _tool_finish(finish: str) -> str:
    """A choice that called tools ends with "tool_calls" (OpenAI's), unless
    it was cut at max_tokens."""
    return "tool_calls" if finish == "stop" else finish

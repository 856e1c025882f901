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

    def last_chunk(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError

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

    def choice(self, result: GenerationResult, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
            "finish_reason": result.finish_reason,
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
        choice = {
            "index": index,
            "delta": {"content": piece},
            "logprobs": shaped,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def last_chunk(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {},
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
        return self._envelope(self.object_chunk, [choice])

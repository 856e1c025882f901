"""The JSON documents of the OpenAI endpoints: a whole answer and the
chunks of its stream, one ``Format`` per endpoint (completions, chat)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from .generation import GenerationResult
from .logprobs import TokenLogprob, chat_logprobs, completion_logprobs

__all__ = ["ChatFormat", "CompletionFormat", "Format", "usage"]


def usage(result: GenerationResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
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

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def chunk(self, piece: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        raise NotImplementedError

    def last_chunk(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk, []), "usage": usage(result)}


class CompletionFormat(Format):
    endpoint = "completions"
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._offset = 0  # text_offset of the next streamed token

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        logprobs = None if result.logprobs is None else completion_logprobs(result.logprobs)
        choice = {"text": result.text, "index": 0, "logprobs": logprobs,
                  "finish_reason": result.finish_reason}  # fmt: skip
        return {**self._envelope(self.object_whole, [choice]), "usage": usage(result)}

    def chunk(self, piece: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        shaped = None
        if logprobs is not None:
            shaped = completion_logprobs(logprobs, self._offset)
            self._offset += sum(len(e.token.text) for e in logprobs)
        choice = {"text": piece, "index": 0, "logprobs": shaped, "finish_reason": None}
        return self._envelope(self.object_chunk, [choice])

    def last_chunk(self, result: GenerationResult) -> dict[str, Any]:
        choice = {"text": "", "index": 0, "logprobs": None,
                  "finish_reason": result.finish_reason}  # fmt: skip
        return self._envelope(self.object_chunk, [choice])


class ChatFormat(Format):
    endpoint = "chat"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prefix = "chatcmpl"

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
            "finish_reason": result.finish_reason,
        }
        return {**self._envelope(self.object_whole, [choice]), "usage": usage(result)}

    def first_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}  # fmt: skip
        return self._envelope(self.object_chunk, [choice])

    def chunk(self, piece: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        shaped = None if logprobs is None else chat_logprobs(logprobs)
        choice = {"index": 0, "delta": {"content": piece}, "logprobs": shaped,
                  "finish_reason": None}  # fmt: skip
        return self._envelope(self.object_chunk, [choice])

    def last_chunk(self, result: GenerationResult) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "logprobs": None,
                  "finish_reason": result.finish_reason}  # fmt: skip
        return self._envelope(self.object_chunk, [choice])

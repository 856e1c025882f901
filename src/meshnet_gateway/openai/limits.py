"""Bounds on what one OpenAI request may make the gateway do, checked before the work.

* ``max_prompt_chars``: characters of a prompt (or of a conversation's roles
  and contents), checked *before* the text is tokenized or rendered — a
  4 MiB prompt used to be encoded whole (seconds of CPU, ~700 MB of peak
  memory) only to be refused for its token count afterwards. The default is
  32 characters per token of context: a prompt that long holds more tokens
  than the context for any tokenizer of natural text (English averages ~4
  characters per token, code and other scripts fewer), so nothing that could
  fit is refused, while a flood is cut at a size proportional to the model.
* ``max_messages``: messages of one chat, counted as soon as the JSON is
  parsed (issue 37): a chat's cost at the gateway grows with its messages,
  not only its characters — 50,000 one-character messages (1.6 MB) took 10x
  the CPU of the same text in one message and ~200 MB to render and
  tokenize, and four clients looping it slowed everyone else from 0.065 s
  to 5.6 s. The default is OpenAI's own bound on ``messages`` (2,048; the
  same 400 ``array_above_max_length``), far above any chat a context holds
  in practice, and it keeps a chat's per-message work to a few MB.
* ``checked_text``: text that cannot be UTF-8 (a lone surrogate such as
  ``"\\ud800"``, which JSON's escapes allow) is a 400, not an exception
  inside the tokenizer.
* ``shown``: a value quoted in an error message is cut short, so a 4 MiB
  string in the wrong field does not come back (and get logged) whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import OpenAIError, invalid

__all__ = ["CHARS_PER_CONTEXT_TOKEN", "MAX_MESSAGES", "PromptLimits", "checked_text", "shown"]

CHARS_PER_CONTEXT_TOKEN = 32
MAX_MESSAGES = 2048  # --max-messages: OpenAI's bound on a chat's ``messages``
_SHOWN = 60  # characters of a bad value an error message quotes


@dataclass(frozen=True, slots=True)
class PromptLimits:
    max_chars: int
    max_messages: int = MAX_MESSAGES

    @classmethod
    def for_context(
        cls, context: int, max_chars: int = 0, max_messages: int = MAX_MESSAGES
    ) -> PromptLimits:
        """``max_chars`` of ``--max-prompt-chars``; 0: 32 per token of context."""
        return cls(max_chars or CHARS_PER_CONTEXT_TOKEN * context, max_messages)

    def check_messages(self, messages: object) -> None:
        """A chat's ``messages``, counted before any of them is looked at
        (what is not a list is left to the request's own checks)."""
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise invalid(
                "messages",
                f"Invalid 'messages': array too long. Expected an array with maximum length "
                f"{self.max_messages}, but got an array with length {len(messages)} instead "
                "(--max-messages).",
                "array_above_max_length",
            )

    def check_chars(self, param: str, texts: Iterable[str]) -> None:
        total = 0
        for text in texts:
            total += len(text)
            if total > self.max_chars:
                raise invalid(
                    param,
                    f"the {param} is longer than {self.max_chars} characters, more than this "
                    "model's context can hold (--max-prompt-chars)",
                    "prompt_too_long",
                )


def checked_text(param: str, text: str) -> str:
    """``text`` if it is valid Unicode for a tokenizer, else a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(
            f"the {param} is not valid Unicode: a lone surrogate at character {exc.start} "
            "(JSON escapes like \\ud800 must come in pairs)",
            param=param,
            code="invalid_unicode",
        ) from None
    return text


def shown(value: object) -> str:
    """A short, printable rendering of a client's value for an error message."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        text = ascii(value)  # JSON ints have at most 4,300 digits: this cannot fail
    else:
        text = type(value).__name__  # a list or an object: its type says enough
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."

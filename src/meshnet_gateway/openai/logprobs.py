"""Log probabilities of the generated tokens, in OpenAI's two shapes.

The numbers come from the sampler (``sampling.Logprobs``): the float64
log-softmax of the last stage's *raw* logits, before logit_bias, penalties,
temperature and the cuts — what vLLM returns by default (its
``logprobs_mode="raw_logprobs"``): the model's own distribution, whatever the
sampling parameters. A logprob below -9999 (a non-finite logit's -inf among
them) is reported as -9999.0, as vLLM clamps it (JSON has no infinity).

Each token's text is the tokenizer's decoding of that one id with special
tokens kept (``</s>`` shows as itself), as vLLM shows it; ``bytes`` are the
token's exact bytes where the tokenizer says them (byte-level BPE, byte
fallback ``<0xNN>`` pieces), so a token holding half a UTF-8 character has
its real bytes even though its text shows U+FFFD.

* Chat (``logprobs: true``, ``top_logprobs`` 0-20):
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}]}`` with exactly ``top_logprobs`` alternatives.
* Completions (``logprobs`` 0-5): the legacy ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``; each ``top_logprobs`` entry maps token
  text to logprob for the ``logprobs`` most likely ids *plus* the chosen one
  (OpenAI: "up to logprobs+1 elements"); ``text_offset`` is each token's
  offset in the completion, the lengths of the token texts before it added
  up (as vLLM computes it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from meshnet_model.sampling import Logprobs

from .tokenizer import ModelTokenizer

__all__ = ["TokenLogprob", "TokenTexts", "chat_logprobs", "completion_logprobs"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte ↔ printable character map (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True, slots=True)
class TokenText:
    text: str
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token, ready for either answer shape."""

    token: TokenText
    logprob: float
    top: tuple[tuple[TokenText, float], ...]


class TokenTexts:
    """Text and bytes of single ids, cached per generation (ids recur)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer.tokenizer
        self._cache: dict[int, TokenText] = {}

    def __call__(self, token: int) -> TokenText:
        known = self._cache.get(token)
        if known is None:
            known = self._cache[token] = self._text(token)
        return known

    def _text(self, token: int) -> TokenText:
        text = self._tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return TokenText(text, tuple(text.encode("utf-8")))
        piece = self._tokenizer.id_to_token(token) or ""
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return TokenText(text, (int(byte.group(1), 16),))
        table = _byte_level_table()
        if piece and all(c in table for c in piece):
            return TokenText(text, tuple(table[c] for c in piece))
        return TokenText(text, tuple(text.encode("utf-8")))

    def entry(self, numbers: Logprobs) -> TokenLogprob:
        return TokenLogprob(
            token=self(numbers.token),
            logprob=numbers.logprob,
            top=tuple((self(i), lp) for i, lp in numbers.top),
        )


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    def one(text: TokenText, logprob: float) -> dict[str, Any]:
        return {"token": text.text, "logprob": logprob, "bytes": list(text.bytes)}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def _top_by_text(entry: TokenLogprob) -> dict[str, float]:
    """Text → logprob; ids of the same text (two half characters) keep the
    most likely one's number, the chosen token's is added if its text is new."""
    top: dict[str, float] = {}
    for text, logprob in (*entry.top, (entry.token, entry.logprob)):
        top.setdefault(text.text, logprob)
    return top


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy object; ``offset``: the text length of the tokens before these."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token.text)
    return {
        "tokens": [e.token.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_by_text(e) for e in entries],
        "text_offset": offsets,
    }

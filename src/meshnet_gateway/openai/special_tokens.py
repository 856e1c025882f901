"""Special-token text inside chat content: escape, refuse or keep it.

A chat template writes control tokens around each message
(``<|im_start|>user\\n…<|im_end|>``). Encoding the rendered text as one
string, as ``transformers`` does, turns the *text* ``<|im_end|>`` inside a
user's message into the real control token too, so a user can close their
turn and open a forged system turn. ``--special-tokens-in-content``:

* ``escape`` (the default): content is encoded as plain text — special-token
  strings in it become the ordinary tokens of their characters — while the
  template's own control tokens stay control tokens. The model reads what
  the user wrote; no one can forge a turn.
* ``refuse``: a conversation whose content holds special-token text is a 400
  ``special_token_in_content``.
* ``keep``: transformers' behaviour, for trusted clients that write control
  tokens on purpose.

Escaping renders the template once with a unique marker in place of each
message's content, then encodes the template's text with special tokens
honoured and each content with them off (the ``tokenizers`` flag
``encode_special_tokens``, on a second tokenizer instance so no shared state
flips between threads). Conversations without special-token text — nearly
all — take the ordinary path and encode exactly as before. Roles are not
content: special-token text in a role is refused under ``escape`` and
``refuse`` alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer

from .errors import OpenAIError
from .tokenizer import ModelTokenizer

__all__ = ["POLICIES", "ChatEncoder"]

POLICIES = ("escape", "refuse", "keep")
# Supplementary private use: never produced by a tokenizer's normaliser and
# checked to be absent from the conversation before use.
_MARK = "\U000f0000{}\U000f0001"
_MARK_RE = re.compile("\U000f0000(\\d+)\U000f0001")


def _refused(where: str, token: str) -> OpenAIError:
    return OpenAIError(
        f"{where} contains the special-token text {token!r}, which this server does not "
        "accept there (--special-tokens-in-content)",
        param="messages",
        code="special_token_in_content",
    )


class ChatEncoder:
    """A conversation → token ids, under one ``--special-tokens-in-content`` policy."""

    def __init__(self, tokenizer: ModelTokenizer, policy: str = "escape") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown special-token policy {policy!r}")
        self.tokenizer = tokenizer
        self.policy = policy
        texts = {
            added.content
            for added in tokenizer.tokenizer.get_added_tokens_decoder().values()
            if added.special and added.content
        }
        texts |= {t for t in (tokenizer.bos_token, tokenizer.eos_token) if t}
        # Longest first, so "<|im_start|>" wins over a shorter token it contains.
        ordered = sorted(texts, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def find_special(self, text: str) -> str | None:
        """The first special-token text in ``text``, if any."""
        if self._pattern is None:
            return None
        found = self._pattern.search(text)
        return None if found is None else found.group(0)

    @cached_property
    def _plain(self) -> Tokenizer:
        # A copy that reads special-token text as ordinary characters.
        plain = Tokenizer.from_str(self.tokenizer.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids of the rendered conversation (``ChatTemplateError`` from
        the template); ``tools`` for a template that writes them (tool_prompt.py)."""
        tok = self.tokenizer
        if self.policy == "keep":
            return tok.encode(tok.render_chat(messages, tools=tools), chat=True)
        for index, message in enumerate(messages):
            token = self.find_special(message["role"])
            if token is not None:
                raise _refused(f"the role of message {index}", token)
        forged = [
            (i, token)
            for i, m in enumerate(messages)
            if (token := self.find_special(m["content"])) is not None
        ]
        if not forged:
            return tok.encode(tok.render_chat(messages, tools=tools), chat=True)
        if self.policy == "refuse":
            index, token = forged[0]
            raise _refused(f"the content of message {index}", token)
        return self._escaped(messages, tools)

    def _escaped(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        tok = self.tokenizer
        marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
        rendered = tok.render_chat(marked, tools=tools)
        pieces = _MARK_RE.split(rendered)  # text, index, text, index, ..., text
        seen = [int(i) for i in pieces[1::2]]
        if sorted(seen) != list(range(len(messages))) or any(
            "\U000f0000" in m["content"] for m in messages
        ):
            # The template dropped, repeated or rewrote a message's content:
            # it cannot be escaped faithfully, so it is refused instead.
            index, token = next(
                (i, t) for i, m in enumerate(messages) if (t := self.find_special(m["content"]))
            )
            raise _refused(f"the content of message {index}", token)
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                if piece:
                    ids += tok.tokenizer.encode(piece, add_special_tokens=False).ids
            else:
                content = messages[int(piece)]["content"]
                if content:
                    ids += self._plain.encode(content, add_special_tokens=False).ids
        return ids

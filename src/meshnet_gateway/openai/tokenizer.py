"""A checkpoint's tokenizer and chat template, as Hugging Face lays them out.

``tokenizer.json`` is read by the ``tokenizers`` library; the special tokens
come from ``tokenizer_config.json``; the chat template from ``chat_template.jinja``
(where transformers 5 saves it; it wins, as in transformers) or else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates of which "default" is used). The template is rendered by jinja2
in an immutable sandbox, the way ``transformers`` renders it (templates ship
inside downloaded checkpoints: they are data, not trusted code).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["ChatTemplateError", "ModelTokenizer", "TextStream"]

# The template of the checkpoints that ship none: plain "role: content" lines.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # HF's tojson keeps non-ASCII text as is (jinja2's own escapes it for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(format: str) -> str:
    # Templates that print today's date (Llama 3.x) call this, as under transformers.
    return datetime.now().strftime(format)


def _eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` (an id or a list of ids) of a JSON config, if any."""
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _chat_template(root: Path, config: Mapping[str, Any]) -> str:
    """The checkpoint's chat template, where transformers would find it."""
    path = root / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else FALLBACK_TEMPLATE


def _token_text(value: Any) -> str | None:
    """``bos_token`` may be a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, Mapping) else None
    return content if isinstance(content, str) else None


@dataclass(frozen=True)  # no slots: cached_property needs a __dict__
class ModelTokenizer:
    """Text ↔ token ids, and a conversation → prompt text."""

    tokenizer: Tokenizer
    chat_template: str
    bos_token: str | None
    eos_token: str | None
    add_bos: bool  # prepend bos to a prompt unless the text already starts with it
    # Every id that ends a generation: the tokenizer's eos token and the
    # eos_token_id(s) of generation_config.json and config.json (chat models
    # often end a turn with a token other than the tokenizer's eos).
    stop_ids: frozenset[int] = frozenset()

    @classmethod
    def load(cls, directory: str | Path) -> ModelTokenizer:
        """Read ``tokenizer.json`` and (optional) ``tokenizer_config.json`` from ``directory``."""
        root = Path(directory)
        if root.suffix.lower() == ".gguf":  # a GGUF file carries its tokenizer in its metadata
            return cls._from_gguf(root)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model directory")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exception on bad files
            raise ValueError(
                f"{path}: not a tokenizer the tokenizers library reads: {exc}"
            ) from None
        config: dict[str, Any] = {}
        config_path = root / "tokenizer_config.json"
        if config_path.is_file():
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"{config_path} is not a JSON object")
            config = loaded
        template = _chat_template(root, config)
        eos_token = _token_text(config.get("eos_token"))
        stop_ids = set(_eos_ids(root / "generation_config.json") + _eos_ids(root / "config.json"))
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            stop_ids.add(eos_id)
        return cls(
            tokenizer=tokenizer,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=eos_token,
            add_bos=bool(config.get("add_bos_token", False)),
            stop_ids=frozenset(stop_ids),
        )

    @classmethod
    def _from_gguf(cls, path: Path) -> ModelTokenizer:
        from meshnet_model.formats.gguf.tokenizer import load_gguf_tokenizer

        spec = load_gguf_tokenizer(path)
        return cls(
            tokenizer=spec.tokenizer,
            chat_template=spec.chat_template or FALLBACK_TEMPLATE,
            bos_token=spec.bos_token,
            eos_token=spec.eos_token,
            add_bos=spec.add_bos,
            stop_ids=spec.stop_ids,
        )

    # ------------------------------------------------------------ ids

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def eos_id(self) -> int | None:
        if self.eos_token is None:
            return None
        return self.tokenizer.token_to_id(self.eos_token)

    @cached_property
    def bos_id(self) -> int | None:
        if self.bos_token is None:
            return None
        return self.tokenizer.token_to_id(self.bos_token)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Prompt text → ids, special tokens written in the text honoured.

        A plain prompt gets the tokenizer's own special tokens (its
        post-processor: Llama 3 adds its bos there) and bos when
        ``add_bos_token`` asks for it and it is still missing. A rendered
        chat template (``chat=True``) already holds every special token it
        wants and gets none added, as ``apply_chat_template`` does.
        """
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=not chat).ids
        bos = self.bos_id
        if not chat and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------ chat

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        return env.from_string(self.chat_template)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation, per the checkpoint's template;
        ``tools`` as transformers passes them (templates test ``if tools``)."""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except Exception as exc:
            # The template is the checkpoint's, the messages the client's: a
            # template tripping over them (a TypeError, say) is a bad request.
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


class TextStream:
    """Turns ids generated one at a time into text pieces safe to emit.

    Decoding ids one by one breaks multi-byte characters and the tokenizer's
    spacing rules, and decoding the whole text at every step costs O(n) per
    token. As vLLM's incremental detokenizer does, only a short window is
    decoded: the ids since ``prefix`` (already emitted, kept as context for
    the spacing rules) and the new ones since ``read``. A piece that ends in
    an unfinished UTF-8 sequence (U+FFFD) is held back until the ids that
    complete it arrive.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this one have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end (a dangling partial character included)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        known = decode(self.ids[self._prefix : self._read])
        text = decode(self.ids[self._prefix :])
        if len(text) <= len(known) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(known) :]

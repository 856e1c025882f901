"""The checkpoint the gateway speaks for: its name, tokenizer and context length."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from meshnet_model.source import is_gguf, load_config, model_name

from .defaults import GenerationDefaults
from .tokenizer import ModelTokenizer

__all__ = ["DEFAULT_CONTEXT", "ServedModel"]

DEFAULT_CONTEXT = 2048  # when config.json names no max_position_embeddings


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """The checkpoint the gateway speaks for: name, tokenizer, context length."""

    name: str
    tokenizer: ModelTokenizer
    context_length: int
    created: int
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # The width of the logits row (config's vocab_size: it may pad the
    # tokenizer's), which a grammar's mask sent to the last stage covers.
    vocab_size: int | None = None

    @classmethod
    def load(cls, directory: str, *, name: str | None = None, context: int = 0) -> ServedModel:
        root = Path(directory)
        tokenizer = ModelTokenizer.load(root)
        gguf = is_gguf(root)  # one .gguf file: config and tokenizer in its metadata
        # The same fail-closed reading as the nodes': a config the chain cannot
        # run exactly is refused here too, before serving (ConfigError).
        config = load_config(root) if gguf or (root / "config.json").is_file() else None
        if not context:
            context = config.max_position_embeddings if config else DEFAULT_CONTEXT
        stat = os.stat(root if gguf else root / "tokenizer.json")
        return cls(
            name=name or model_name(root),
            tokenizer=tokenizer,
            context_length=context,
            created=int(stat.st_mtime),
            defaults=GenerationDefaults.load(root),
            vocab_size=config.vocab_size if config else None,
        )

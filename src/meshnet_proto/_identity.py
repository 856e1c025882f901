"""A node's identity document (wire-2 §6.1), parsed into a bounded
``StageIdentity``: a peer wrote it, so every field is checked and junk is an
``IdentityError`` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["IdentityError", "StageIdentity", "MAX_COUNT", "is_int"]

# Bounds on what a peer may claim (a document is a peer's, never trusted).
MAX_TEXT = 100
MAX_COUNT = 1 << 31  # layers, vocabulary, hidden size, context: far above any model
_HEX = re.compile(r"[0-9a-f]{32}")
_SIDES = ("tokens", "hidden", "logits", "any")


class IdentityError(ValueError):
    """An identity or health document that is not what wire-2 §6 says."""


@dataclass(frozen=True, slots=True)
class StageIdentity:
    """A node's ``identity`` (wire-2 §6.1), checked field by field."""

    fingerprint: str
    model: str
    weights: str | None
    tokenizer: str | None
    layers: tuple[int, int] | None
    n_layers: int | None
    vocab: int | None
    hidden: int | None
    max_context: int | None
    engine: str | None
    dtype: str | None
    input: str
    output: str
    wire_dtype: str
    encoding: str

    @classmethod
    def from_json(cls, obj: Any) -> StageIdentity:
        """Parse a peer's identity object; ``IdentityError`` names what is wrong."""
        if not isinstance(obj, dict):
            raise IdentityError(f"identity must be an object, not {type(obj).__name__}")
        fingerprint = _text(obj, "fingerprint")
        if not _HEX.fullmatch(fingerprint):
            raise IdentityError("identity.fingerprint must be 32 lowercase hex digits")
        n_layers = _count(obj, "n_layers")
        layers = _layers(obj.get("layers"), n_layers)
        return cls(
            fingerprint=fingerprint,
            model=_text(obj, "model"),
            weights=_text(obj, "weights", optional=True),
            tokenizer=_text(obj, "tokenizer", optional=True),
            layers=layers,
            n_layers=n_layers,
            vocab=_count(obj, "vocab"),
            hidden=_count(obj, "hidden"),
            max_context=_count(obj, "max_context"),
            engine=_text(obj, "engine", optional=True),
            dtype=_text(obj, "dtype", optional=True),
            input=_side(obj, "input"),
            output=_side(obj, "output"),
            wire_dtype=_text(obj, "wire_dtype"),
            encoding=_text(obj, "encoding"),
        )

    def describe(self) -> str:
        """Short, for messages: the model and the layers."""
        if self.layers is None:
            return self.model
        return f"{self.model[:12]} layers {self.layers[0]}:{self.layers[1]}"


def _text(obj: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        kind = "null or " if optional else ""
        raise IdentityError(f"identity.{key} must be {kind}a string of 1-{MAX_TEXT} characters")
    return value


def _count(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_int(value) or not 1 <= value <= MAX_COUNT:
        raise IdentityError(f"identity.{key} must be null or an integer in 1..{MAX_COUNT}")
    return int(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layers(value: Any, n_layers: int | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(is_int(v) for v in value)
        or n_layers is None
        or not 0 <= value[0] <= value[1] <= n_layers
    ):
        raise IdentityError(
            "identity.layers must be null or [start, stop] with 0 <= start <= stop <= n_layers"
        )
    return (value[0], value[1])


def _side(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if value not in _SIDES:
        raise IdentityError(f"identity.{key} must be one of {', '.join(_SIDES)}")
    return str(value)

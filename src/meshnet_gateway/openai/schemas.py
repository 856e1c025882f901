"""The JSON schemas a request brings (``response_format``, a tool's
``parameters``), bounded before any grammar is built from them.

A schema is the client's data that becomes compute: its size and nesting
are checked here, in the request's worker thread, by an iterative walk (no
recursion a deep schema could exhaust); what the grammar library cannot do
(``if``/``then``, ``dependentSchemas``, …) it refuses by name, and so do we
(grammar.py). ``response_format`` itself: ``text`` (nothing to constrain),
``json_object`` (any JSON object) or ``json_schema`` (OpenAI's shape: a
``name``, an optional ``description``, the ``schema``, ``strict``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import invalid

__all__ = ["MAX_SCHEMA_BYTES", "MAX_SCHEMA_DEPTH", "checked_schema", "response_schema"]

# A schema's JSON (OpenAI's own bound on a strict schema is of the same
# order: 100 properties, 10 levels, 15,000 characters of names and enums).
MAX_SCHEMA_BYTES = 64 * 1024
# Objects and arrays inside one another.
MAX_SCHEMA_DEPTH = 32
# OpenAI's rule for a response format's and a function's name.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def checked_schema(schema: Any, param: str) -> dict[str, Any] | bool:
    """``schema`` if it is a JSON schema (an object, or true/false) within
    the bounds; a 400 naming ``param`` otherwise."""
    if not isinstance(schema, dict | bool):
        raise invalid(param, f"{param} must be a JSON schema (an object)", "invalid_type")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        why = f"{param}: the schema has {size} bytes of JSON (at most {MAX_SCHEMA_BYTES})"
        raise invalid(param, why, "schema_too_large")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        why = f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        raise invalid(param, why, "schema_too_deep")
    return schema


def _depth(value: Any) -> int:
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break  # deep enough to refuse: no need to walk the rest
        pending.extend((child, depth + 1) for child in children)
    return deepest


def response_schema(value: Any) -> dict[str, Any] | bool | None:
    """The schema ``response_format`` constrains the answer to, or None for
    ``text`` (or no response_format)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format", "response_format must be an object", "invalid_type")
    kind = value.get("type")
    if not isinstance(kind, str):
        raise invalid("response_format", "response_format needs a 'type'", "invalid_type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        why = f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        raise invalid("response_format", why[:300], "invalid_value")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid(param, f"{param} must be an object", "invalid_type")
    name = spec.get("name")
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        why = f"{param}.name: 1 to 64 letters, digits, '_' or '-'"
        raise invalid(f"{param}.name", why, "invalid_value")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{param}.strict", f"{param}.strict must be a boolean", "invalid_type")
    if "schema" not in spec:
        # OpenAI's default: any JSON object (strict or not, we constrain).
        return {"type": "object"}
    return checked_schema(spec["schema"], f"{param}.schema")

"""JSON schemas an agent sends with strict structured output, and hostile ones.

``CORPUS``: fifty small schemas, each ``{"name": ..., "schema": ...}`` (the
``json_schema`` object of OpenAI's ``response_format`` without ``strict``),
of the kinds agents send: enums, nested objects, bounded arrays, ``anyOf``,
bounded numbers, the common string formats, ``$defs``/``$ref``, ``const``,
booleans and nulls. Every string has a ``maxLength`` and every array a
``maxItems``, so that SmolLM2-135M fills any of them within ~120 tokens:
a test generates an answer for each with the real model.

``HOSTILE``: schemas a client may send to hurt the server — too large, too
deep, recursive, pathological regular expressions, a 100,000-value enum,
keywords llguidance does not implement, values that are not schemas — each
with what the gateway is expected to do with it, as ``response_format`` and
as a tool's ``parameters``: refuse it (400) or answer within bounds (200,
``finish_reason`` "length" at ``max_tokens`` or content that parses).

The expectations were checked against llguidance 1.9.1 itself (compile,
validate, a matcher and its first masks with the real model's tokenizer);
the gateway's own limits (64 KiB of schema, depth 32, 128 tools) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CORPUS", "HOSTILE", "MISSING", "Hostile", "Raw", "deep_object", "raw_json"]

Schema = dict[str, Any]


def _s(max_length: int = 16, **more: Any) -> Schema:
    return {"type": "string", "maxLength": max_length, **more}


def _obj(required: tuple[str, ...] | None = None, /, **properties: Any) -> Schema:
    """A closed object: every property required unless ``required`` says which."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


def _enum(*values: Any) -> Schema:
    return {"enum": list(values)}


def _arr(items: Any, low: int = 1, high: int = 3) -> Schema:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


def _int(low: int, high: int) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


BOOL: Schema = {"type": "boolean"}
NULL: Schema = {"type": "null"}
DATE: Schema = {"type": "string", "format": "date"}
EMAIL = _s(32, format="email")

_CORPUS: list[tuple[str, Schema]] = [
    ("sentiment", _obj(label=_enum("positive", "negative", "neutral"))),
    ("yes_no", _obj(answer=BOOL)),
    ("weather", _obj(city=_s(), unit=_enum("celsius", "fahrenheit"), temp=_int(-60, 60))),
    ("person", _obj(name=_s(), age=_int(0, 120), email=EMAIL)),
    ("rating", _obj(stars=_int(1, 5), comment=_s(24))),
    ("tags", _obj(tags=_arr(_s(10), 1, 3))),
    (
        "point",
        _obj(
            x={"type": "number", "minimum": -10, "maximum": 10},
            y={"type": "number", "minimum": -10, "maximum": 10},
        ),
    ),
    (
        "probability",
        _obj(
            p={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.01}
        ),
    ),
    ("event", _obj(title=_s(20), date=DATE)),
    ("contact", _obj(email=EMAIL, phone=_s(14, pattern=r"^\+?[0-9]{7,12}$"))),
    ("address", _obj(street=_s(), city=_s(), zip=_s(5, pattern="^[0-9]{5}$"))),
    ("order", _obj(item=_s(), quantity=_int(1, 9), express=BOOL)),
    ("nested", _obj(user=_obj(id=_int(1, 999), name=_s(12)), active=BOOL)),
    ("optional_note", _obj(("title",), title=_s(), note=_s(20))),
    ("nullable", _obj(value={"type": ["string", "null"], "maxLength": 10})),
    ("any_of", _obj(result={"anyOf": [_int(0, 99), _s(8)]})),
    (
        "any_of_objects",
        _obj(
            shape={
                "anyOf": [
                    _obj(kind={"const": "circle"}, r=_int(1, 9)),
                    _obj(kind={"const": "square"}, side=_int(1, 9)),
                ]
            }
        ),
    ),
    ("const", _obj(version={"const": "v1"}, ok=BOOL)),
    ("null_field", _obj(error=NULL, done=BOOL)),
    (
        "defs_ref",
        {
            "$defs": {"money": _obj(amount=_int(0, 1000), currency=_enum("EUR", "USD"))},
            **_obj(price={"$ref": "#/$defs/money"}, tax={"$ref": "#/$defs/money"}),
        },
    ),
    (
        "defs_enum_ref",
        {
            "$defs": {"color": _enum("red", "green", "blue")},
            **_obj(fg={"$ref": "#/$defs/color"}, bg={"$ref": "#/$defs/color"}),
        },
    ),
    ("int_list", _obj(numbers=_arr(_int(0, 100), 1, 4))),
    ("bool_list", _obj(flags=_arr(BOOL, 2, 3))),
    ("matrix", _obj(rows=_arr(_arr(_int(0, 9), 2, 2), 2, 2))),
    ("todo", _obj(items=_arr(_obj(task=_s(12), done=BOOL), 1, 2))),
    ("language", _obj(code=_enum("en", "fr", "de", "es", "it"), confidence=_int(0, 100))),
    ("translation", _obj(source=_s(20), target=_s(20))),
    ("classification", _obj(category=_enum("bug", "feature", "question"), urgent=BOOL)),
    ("entity", _obj(text=_s(16), type=_enum("PERSON", "ORG", "PLACE"))),
    ("entities", _obj(entities=_arr(_obj(text=_s(10), type=_enum("PER", "LOC")), 1, 2))),
    ("math", _obj(expression=_s(16), result=_int(-1000, 1000))),
    ("temperature", _obj(celsius={"type": "number", "minimum": -50, "maximum": 50})),
    ("percent", _obj(value={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100})),
    ("date_range", _obj(start=DATE, end=DATE)),
    ("username", _obj(username=_s(12, minLength=3, pattern="^[a-z][a-z0-9_]*$"))),
    ("hex_color", _obj(color={"type": "string", "pattern": "^#[0-9a-f]{6}$"})),
    ("summary", _obj(summary=_s(40), words=_int(1, 50))),
    ("keywords", _obj(keywords=_arr(_s(10), 1, 3), lang=_enum("en", "fr"))),
    ("mixed_enum", _obj(level=_enum(1, 2, 3, "max", None))),
    ("step", _obj(step=_int(1, 3), action=_enum("read", "write"), target=_s(12))),
    ("http_call", _obj(method=_enum("GET", "POST"), path=_s(16, pattern="^/[a-z/]*$"))),
    ("pair", _obj(key=_s(8), value=_s(8))),
    ("score", _obj(home=_int(0, 20), away=_int(0, 20), final=BOOL)),
    (
        "product",
        _obj(sku=_s(8), price={"type": "number", "minimum": 0, "maximum": 999}, in_stock=BOOL),
    ),
    ("short_answer", _obj(answer=_s(24))),
    ("choice", _obj(option={"anyOf": [{"const": "a"}, {"const": "b"}, {"const": "c"}]})),
    ("meeting", _obj(day=_enum("mon", "tue", "wed", "thu", "fri"), hour=_int(8, 18))),
    ("deep", _obj(a=_obj(b=_obj(c=_obj(d=_int(0, 9)))))),
    ("optional_list", _obj(("name",), name=_s(10), aliases=_arr(_s(8), 0, 2))),
    ("bare_enum", _enum("alpha", "beta", "gamma")),
]

CORPUS: list[Schema] = [{"name": name, "schema": schema} for name, schema in _CORPUS]


# ------------------------------------------------------------ hostile

Expect = Literal["refused", "bounded"]


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text spliced into the request body as it is: a document Python's
    own encoder cannot write (1,000 levels deep), or one that is not JSON."""

    text: str


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # the key is left out of the request


@dataclass(frozen=True, slots=True)
class Hostile:
    """One hostile schema: ``schema`` goes to ``json_schema.schema`` and to a
    tool's ``function.parameters`` (``MISSING``: the key left out), unless
    ``whole`` says it replaces the ``json_schema`` object itself (and the
    tool's ``function`` object). What the gateway should do in each place:
    ``as_format`` and ``as_tool``."""

    name: str
    schema: Any
    as_format: Expect
    as_tool: Expect
    whole: bool = False

    @property
    def size(self) -> int:
        return 0 if self.schema is MISSING else len(raw_json(self.schema))


def raw_json(value: Any) -> str:
    """The JSON text of a hostile value (``Raw`` as it is)."""
    import json

    return value.text if isinstance(value, Raw) else json.dumps(value)


def deep_object(depth: int) -> Raw:
    """An object schema nested ``depth`` levels (each a property of the one above)."""
    head = '{"type":"object","properties":{"a":'
    return Raw(head * depth + '{"type":"string","maxLength":4}' + "}}" * depth)


def _huge() -> Schema:
    """Over 64 KiB: 800 properties with a description each (~80 KiB)."""
    properties = {f"field_{i}": _s(8, description="x" * 64) for i in range(800)}
    return {"type": "object", "properties": properties, "additionalProperties": False}


_RECURSIVE: Schema = {
    "$defs": {"node": _obj(("name",), name=_s(8), children=_arr({"$ref": "#/$defs/node"}, 0, 2))},
    "$ref": "#/$defs/node",
}
_SELF: Schema = _obj(("value",), value=_int(0, 9), next={"$ref": "#"})
_LOOP: Schema = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}


def _pattern(regex: str) -> Schema:
    return _obj(text={"type": "string", "pattern": regex})


def _keyword(**keywords: Any) -> Schema:
    return {**_obj(a=_s(8), b=_s(8)), **keywords}


HOSTILE: list[Hostile] = [
    Hostile("huge_80k", _huge(), "refused", "refused"),
    Hostile("deep_40", deep_object(40), "refused", "refused"),
    Hostile("deep_1000", deep_object(1000), "refused", "refused"),
    Hostile("recursive_defs", _RECURSIVE, "bounded", "bounded"),
    Hostile("recursive_root", _SELF, "bounded", "bounded"),
    Hostile("ref_loop", _LOOP, "refused", "refused"),
    Hostile("ref_missing", _obj(a={"$ref": "#/$defs/nope"}), "refused", "refused"),
    Hostile("ref_remote", _obj(a={"$ref": "https://example.com/s.json"}), "refused", "refused"),
    Hostile("regex_nested_plus", _pattern("(a+)+$"), "bounded", "bounded"),
    Hostile("regex_alternation", _pattern("(a|aa)*b"), "bounded", "bounded"),
    # A tool's parameters are written into the prompt as well: one this
    # large passes the model's context (8,192 tokens) before any grammar.
    Hostile(
        "regex_10k_chars",
        _pattern("(" + "|".join(f"w{i:04d}" for i in range(1700)) + ")"),
        "bounded",
        "refused",
    ),
    Hostile("regex_repeat_1e6", _pattern("a{1000000}"), "bounded", "bounded"),
    Hostile("regex_dfa_blowup", _pattern("^[ab]*a[ab]{30}$"), "bounded", "bounded"),
    Hostile("regex_nested_repeats", _pattern("^((a{1,100}){1,100}){1,100}$"), "bounded", "bounded"),
    Hostile("regex_backreference", _pattern(r"(a)\1"), "refused", "refused"),
    Hostile("regex_lookahead", _pattern("(?=a)a"), "refused", "refused"),
    Hostile("regex_invalid", _pattern("(("), "refused", "refused"),
    Hostile(
        "min_length_1e6", _obj(v={"type": "string", "minLength": 1_000_000}), "bounded", "bounded"
    ),
    Hostile(
        "min_items_1e6",
        _obj(v={"type": "array", "items": BOOL, "minItems": 1_000_000}),
        "bounded",
        "bounded",
    ),
    Hostile("wide_1000", _obj(**{f"p{i}": BOOL for i in range(1000)}), "bounded", "refused"),
    Hostile(
        "any_of_2000",
        _obj(v={"anyOf": [{"const": f"c{i}"} for i in range(2000)]}),
        "bounded",
        "refused",
    ),
    Hostile("minimum_over_maximum", _obj(v=_int(10, 1)), "refused", "refused"),
    Hostile("integer_range_1e30", _obj(v=_int(-(10**30), 10**30)), "refused", "refused"),
    Hostile("enum_100k", _obj(v=_enum(*(f"v{i}" for i in range(100_000)))), "refused", "refused"),
    Hostile(
        "pattern_properties",
        {"type": "object", "patternProperties": {"^a": _s(4)}, "maxProperties": 2},
        "bounded",
        "bounded",
    ),
    Hostile(
        "if_then_else",
        _keyword(**{"if": _obj(a={"const": "x"}), "then": {}, "else": {}}),
        "refused",
        "refused",
    ),
    Hostile(
        "dependent_schemas",
        _keyword(dependentSchemas={"a": {"required": ["b"]}}),
        "refused",
        "refused",
    ),
    Hostile("unique_items", _obj(v={**_arr(_s(4)), "uniqueItems": True}), "refused", "refused"),
    Hostile("not", _obj(v={"not": {"type": "string"}}), "refused", "refused"),
    Hostile("unknown_format", _obj(v=_s(8, format="frobnicate")), "refused", "refused"),
    Hostile("unknown_type", {"type": "frobnicate"}, "refused", "refused"),
    Hostile("false_schema", False, "refused", "refused"),
    Hostile("true_schema", True, "bounded", "bounded"),
    Hostile("schema_a_list", [1, 2, 3], "refused", "refused"),
    Hostile("schema_a_string", "an object, please", "refused", "refused"),
    Hostile("schema_null", None, "refused", "refused"),
    # OpenAI's default in both places: any JSON object.
    Hostile("missing_schema", MISSING, "bounded", "bounded"),
    Hostile("json_schema_a_string", "schema", "refused", "refused", whole=True),
    Hostile("json_schema_a_list", [{"type": "object"}], "refused", "refused", whole=True),
]

"""Constrained decoding: the ids a grammar allows next, as a mask applied
where the token is drawn (``meshnet_model.sampling.TokenConstraint``).

The grammar library is llguidance (the one llama.cpp and vLLM use; the
comparison with xgrammar and outlines-core is in docs/openai-api.md,
"Constrained decoding"). A request's JSON schema or tool-call grammar is
compiled and validated in the request's worker thread, before admission,
under this module's limits and llguidance's own (``LIMITS``): a grammar it
cannot build within them is a 400 naming the parameter, never a hung
worker. Each step then costs one mask computation (bounded by llguidance's
per-step fuel) and one token consumed.

The grammar's state is a function of the tokens generated so far: the
gateway holds it, draws the constrained tokens from the logits the last
stage relays (wire-2 §3.13: a draw that needs the history stays at the
sender), and a failover by replay, which replays the same tokens, leaves it
where it was.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from meshnet_proto import MeshnetError

from .errors import invalid
from .tokenizer import ModelTokenizer

__all__ = ["Constraint", "Grammar", "GrammarCompiler", "LIMITS"]

# llguidance's own bounds, tightened where a request could make a worker
# spend seconds: fuel is its unit of work (~50k/ms building the lexer,
# ~14k/ms per step), so a grammar costs at most ~20 ms to build and a step's
# mask at most ~7 ms, whatever the schema.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=100_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    # Errors name the schema's problem, not the parser's internal state.
    verbose_errors=False,
)


@dataclass(frozen=True, slots=True)
class Grammar:
    """A validated grammar (llguidance's serialised form) for one request."""

    text: str
    compiler: GrammarCompiler

    def constraint(self) -> Constraint:
        """A fresh matcher at the grammar's start: one per generation."""
        return Constraint(self.compiler, self.text)


class GrammarCompiler:
    """The served model's vocabulary as llguidance sees it, built once (about
    two seconds for 49k tokens) on first use, and the grammars of requests."""

    def __init__(self, tokenizer: ModelTokenizer, width: int | None = None) -> None:
        """``width``: the ids of the model's logits row (its config's
        ``vocab_size``, which may pad the tokenizer's); the tokenizer's by default."""
        self._tokenizer = tokenizer
        self.width = max(width or 0, tokenizer.vocab_size)
        self._built: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # two first requests build it once

    @property
    def vocab(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                eos = sorted(self._tokenizer.stop_ids)
                self._built = llguidance.LLTokenizer(
                    self._tokenizer.tokenizer.to_str(),
                    n_vocab=self._tokenizer.vocab_size,
                    eos_token=eos or None,
                )
            return self._built

    def json_schema(self, schema: dict[str, Any] | bool, param: str) -> Grammar:
        """The grammar of one JSON value that validates against ``schema``,
        written compactly (no whitespace between tokens: a model reading its
        own output never needs it, and a free-whitespace grammar lets a
        small model wander in blank lines until ``max_tokens``)."""
        if schema is False:
            raise invalid(param, f"{param}: the schema false allows no answer", "invalid_schema")
        if schema is True:
            schema = {}  # any JSON value, as true says
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_COMPACT)
        return self._checked(text, param)

    def lark(self, grammar: str, param: str) -> Grammar:
        """A Lark grammar (llguidance's dialect: ``%json {…}`` embeds a schema)."""
        return self._checked(llguidance.LLMatcher.grammar_from_lark(grammar), param)

    def _checked(self, text: str, param: str) -> Grammar:
        """Validated, and its first step taken: a grammar that only fails
        once it runs (a ``$ref`` loop) is refused here, not mid-answer."""
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=LIMITS
        )
        if error:
            raise invalid(param, f"{param}: {_first_line(messages)}", "invalid_schema")
        grammar = Grammar(text, self)
        try:
            grammar.constraint().allowed(self.width)
        except GrammarFailed as exc:
            why = f"{param}: no value can be generated from the schema ({_first_line([str(exc)])})"
            raise invalid(param, why, "invalid_schema") from None
        return grammar


# Compact JSON: "," and ":" without spaces, no free whitespace.
_COMPACT: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _first_line(messages: list[str]) -> str:
    text = messages[0] if messages else "the grammar is not valid"
    return text.strip().splitlines()[0][:500] if text.strip() else "the grammar is not valid"


class Constraint:
    """One generation's grammar state: the mask of the next token, advanced
    by every token chosen."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        tokenizer = compiler.tokenizer
        self.width = compiler.width  # the masks the wire carries cover this many ids
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        self._vocab = tokenizer.vocab_size
        words = (self._vocab + 31) // 32
        self._bits = np.zeros((1, words), dtype=np.int32)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end-of-sequence id may come."""
        return bool(self._matcher.is_stopped() or self._matcher.is_accepting())

    def allowed(self, size: int) -> np.ndarray:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise GrammarFailed(self._matcher.get_error())
        flags = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        mask = np.zeros(size, dtype=bool)
        kept = min(size, self._vocab)
        mask[:kept] = flags[:kept].astype(bool)
        if not mask.any():
            raise GrammarFailed("the grammar allows no token of this vocabulary next")
        return mask

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarFailed(self._matcher.get_error() or f"token {token} refused")


class GrammarFailed(RuntimeError):
    """The grammar reached a state it cannot leave (a step out of fuel, or a
    token it refused): the generation fails instead of going on unconstrained."""


def grammar_error(exc: GrammarFailed) -> MeshnetError:
    """The request's failure (its grammar, not the chain's): 400."""
    return MeshnetError(
        f"the response_format or tool grammar failed: {exc}", code="grammar_failed", status=400
    )

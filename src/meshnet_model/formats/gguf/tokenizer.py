"""The tokenizer a GGUF file describes, as a ``tokenizers.Tokenizer``.

A GGUF file has no ``tokenizer.json``; its metadata holds the vocabulary
(``tokenizer.ggml.tokens``, ``token_type``, ``scores`` or ``merges``), the
special ids and the chat template. Two kinds are built, the ones the
families we run use (``tokenizer.ggml.model``):

* ``llama`` — sentencepiece BPE (Llama 2, Mistral, SmolLM-style files): a BPE
  over the pieces with byte fallback (``<0x41>`` tokens), spaces written
  ``▁`` and one prepended to the text (``add_space_prefix``, default on). When
  the file lists no merges, they are recovered from the piece scores: every
  split of a piece into two pieces is a merge, ranked by the piece's score
  (a sentencepiece BPE scores its pieces by merge order), ties by the longer
  left part, then the vocabulary order.
* ``gpt2`` — byte-level BPE (Llama 3, Qwen): tokens spelled in GPT-2's byte
  alphabet, explicit merges, and the text split first by the regular
  expression of the file's ``tokenizer.ggml.pre`` (an unknown one is refused:
  a wrong split gives other ids without any error).

Tokens typed CONTROL (3) or UNKNOWN (2) become special tokens (matched whole, dropped when
decoding), USER_DEFINED (4) plain added tokens (matched whole, kept). This is
how transformers builds the same file (``AutoTokenizer(..., gguf_file=...)``);
the tests compare the ids of both on a multilingual sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from .file import GGUFFile

__all__ = ["GGUFTokenizer", "load_gguf_tokenizer"]

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Every digit its own piece, then GPT-2's split (llama.cpp's "\p{N}" rule before
# the GPT-2 one; the Digits + ByteLevel pre-tokenizer of SmolLM's tokenizer.json).
_DIGITS_THEN_GPT2 = "digits"
# tokenizer.ggml.pre → the split regex; "default" (or none) is GPT-2's own.
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class GGUFTokenizer:
    """What the gateway needs from a GGUF file to speak the OpenAI API."""

    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    stop_ids: frozenset[int]
    context_length: int | None


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 upwards, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece BPE vocabulary (see the module doc)."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [
            (token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in index and token[k:] in index
        ]
        pairs.sort(key=lambda p: (index[p[0]], index[p[1]]))
        ranked.extend((score, len(a), len(b), a, b) for a, b in pairs)
    # Stable: best score first, then the longer left, then the longer right part.
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(a, b) for _, _, _, a, b in ranked]


def _list(file: GGUFFile, key: str, required: bool = False) -> list[Any] | None:
    value = file.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, list):
        raise CheckpointError(f"{file.path}: {key} must be an array, got {type(value).__name__}")
    return value


def _sentencepiece(file: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges_text = _list(file, "tokenizer.ggml.merges")
    if merges_text is not None:
        merges = [tuple(m.split(" ", 1)) for m in merges_text]
    else:
        scores = _list(file, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(
                f"{file.path}: a llama tokenizer needs tokenizer.ggml.scores (one per token) "
                "or tokenizer.ggml.merges"
            )
        merges = _score_merges(tokens, [float(s) for s in scores])
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = file.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _byte_level(file: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZER_SPLITS)})"
        )
    merges_text = _list(file, "tokenizer.ggml.merges", required=True)
    assert merges_text is not None
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # A token outside the byte alphabet (an added token written as text) is
    # respelled through its UTF-8 bytes, as the BPE model sees text.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in merges_text]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif split == _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _token(tokens: list[str], file: GGUFFile, key: str) -> tuple[int | None, str | None]:
    value = file.get(f"tokenizer.ggml.{key}_token_id")
    if isinstance(value, int) and 0 <= value < len(tokens):
        return value, tokens[value]
    return None, None


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer, chat template, special tokens and context of a GGUF file."""
    from tokenizers import AddedToken

    file = GGUFFile(path)
    kind = file.get("tokenizer.ggml.model")
    tokens = _list(file, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise CheckpointError(f"{file.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.*)")
    if kind == "llama":
        tok = _sentencepiece(file, tokens)
    elif kind == "gpt2":
        tok = _byte_level(file, tokens)
    else:
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported (supported: llama, gpt2)"
        )
    types = _list(file, "tokenizer.ggml.token_type") or []
    byte_level = kind == "gpt2"
    spelled = set(byte_alphabet().values())
    special, plain = [], []
    for token, token_type in zip(tokens, types, strict=False):
        # <unk> too: transformers registers it as a special token.
        if token_type in (_UNKNOWN, _CONTROL) and (not byte_level or set(token) <= spelled):
            special.append(AddedToken(token, normalized=False, special=True))
        elif token_type == _USER_DEFINED:
            plain.append(AddedToken(token, normalized=False, special=False))
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    _, bos = _token(tokens, file, "bos")
    eos_id, eos = _token(tokens, file, "eos")
    stop = {eos_id} if eos_id is not None else set()
    eot_id, _ = _token(tokens, file, "eot")  # end of turn (Llama 3's <|eot_id|>)
    if eot_id is not None:
        stop.add(eot_id)
    add_bos = file.get("tokenizer.ggml.add_bos_token")
    template = file.get("tokenizer.chat_template")
    context = file.get(f"{file.architecture}.context_length")
    return GGUFTokenizer(
        tokenizer=tok,
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos,
        eos_token=eos,
        # llama.cpp adds bos to a sentencepiece vocabulary unless told otherwise.
        add_bos=bool(add_bos) if add_bos is not None else kind == "llama",
        stop_ids=frozenset(stop),
        context_length=context if isinstance(context, int) and context > 0 else None,
    )

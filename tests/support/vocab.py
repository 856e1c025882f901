"""Tiny trained vocabularies for the GGUF tests, as ``GGUFVocab`` metadata.

``sentencepiece_vocab`` and ``byte_level_vocab`` train tiny tokenizers on a
multilingual text sample, locally (sentencepiece BPE with byte fallback, as
Llama/Mistral use, and byte-level BPE as Qwen uses), so a test has a real
vocabulary without downloading one. Here, not in ``meshnet_model.testing.gguf``,
because sentencepiece is a test-only package.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

from meshnet_model.testing.gguf import GGUFVocab

__all__ = ["SAMPLE_TEXT", "byte_level_vocab", "sentencepiece_vocab"]

SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2026, and we're testing 123 tokens!",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我能吞下玻璃而不伤身体。天下大势，分久必合，合久必分。",  # noqa: RUF001
    "いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر",
    "def main(argv):\n    return {'ok': True, \"n\": [1, 2, 3]}  # code\n",
    "Emoji 🎉🚀 and symbols ∑ ∫ √ ≤ ≥ → ← ★ € £ ¥",
    "Numbers 3.14159 2.71828 1,000,000 and tabs\tand\nnewlines\n\n end",
]


def sentencepiece_vocab(vocab_size: int = 800, text: Sequence[str] = SAMPLE_TEXT) -> GGUFVocab:
    """A sentencepiece BPE vocabulary with byte fallback (Llama/Mistral style)."""
    import sentencepiece as spm

    model = io.BytesIO()
    user_defined = ["<think>"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(text) * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=user_defined,
        control_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif piece in user_defined:
            types.append(4)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    return GGUFVocab(
        model="llama",
        tokens=tokens,
        token_types=types,
        scores=scores,
        bos_id=sp.bos_id(),
        eos_id=sp.eos_id(),
        unk_id=sp.unk_id(),
        add_bos=True,
        add_space_prefix=True,
    )


# Qwen2's pre-tokenizer split (llama.cpp's "qwen2" pre type).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_vocab(vocab_size: int = 600, text: Sequence[str] = SAMPLE_TEXT) -> GGUFVocab:
    """A byte-level BPE vocabulary with Qwen-style special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(text) * 4, trainer=trainer)
    vocab = tok.get_vocab(with_added_tokens=False)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges_raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges_raw]
    types = [1] * len(tokens)
    for special in specials:
        tokens.append(special)
        types.append(3)
    tokens.append("<think>")
    types.append(4)
    eos = tokens.index("<|im_end|>")
    return GGUFVocab(
        model="gpt2",
        tokens=tokens,
        token_types=types,
        merges=merges,
        pre="qwen2",
        bos_id=tokens.index("<|endoftext|>"),
        eos_id=eos,
        pad_id=tokens.index("<|endoftext|>"),
        add_bos=False,
    )

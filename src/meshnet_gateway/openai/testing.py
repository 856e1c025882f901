"""Tiny tokenizers for tests and benchmarks: trained here, no download.

``write_tokenizer(directory, vocab_size)`` writes ``tokenizer.json`` and
``tokenizer_config.json`` (with a chat template) next to a checkpoint, with
exactly ``vocab_size`` ids so that every id a model can produce decodes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "write_tokenizer"]

BOS, EOS = "<s>", "</s>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]

# Zephyr-style: role markers, eos after each turn; exercises raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a pipeline of nodes carries activations over the wire",
    "hello world, hello meshnet; tokens flow from the gateway to the last stage",
    "once upon a time there was a small model split across three machines",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation . , ; : ! ?",
]


def write_tokenizer(
    directory: str | Path, vocab_size: int = 320, extra_corpus: Sequence[str] = ()
) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` ids into ``directory``;
    ``extra_corpus``: texts it learns first (a test's own merges, such as
    runs of one letter)."""
    base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < base:
        raise ValueError(f"vocab_size must be >= {base} (bytes + special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*extra_corpus, *CORPUS * 4], trainer=trainer)
    # A small corpus runs out of merges: pad with special tokens so every id
    # below vocab_size exists (a model may sample any of them).
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return root

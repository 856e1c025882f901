"""The tokenizer of a GGUF file: our build vs transformers' (``AutoTokenizer(gguf_file=)``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet_gateway.openai.api import ServedModel
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.errors import CheckpointError
from meshnet_model.formats.gguf.tokenizer import byte_alphabet, load_gguf_tokenizer
from meshnet_model.testing import random_weights, small_config
from meshnet_model.testing.gguf import write_gguf
from support.gguf import CHAT_TEMPLATE, vocab_for
from support.vocab import SAMPLE_TEXT

transformers = pytest.importorskip("transformers")

SPECIALS = {
    "llama": "hi </s> <think> x <|im_start|>user\nhallo<|im_end|> <unk> <s>",
    "qwen2": "hi <|endoftext|> <think> x <|im_start|>user\nhallo<|im_end|>\n",
}


def _write(root: Path, kind: str, **overrides: object) -> Path:
    vocab = vocab_for(kind)
    config = small_config(vocab_size=len(vocab.tokens)).to_dict()
    config["model_type"] = kind
    weights = random_weights(small_config(vocab_size=len(vocab.tokens)), seed=1)
    path = root / f"{kind}.gguf"
    write_gguf(path, config, weights, vocab=vocab, chat_template=CHAT_TEMPLATE,
               **overrides)  # type: ignore[arg-type]  # fmt: skip
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ids_equal_transformers_on_a_multilingual_sample(tmp_path: Path, kind: str) -> None:
    path = _write(tmp_path, kind)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = ModelTokenizer.load(path)
    texts = [*SAMPLE_TEXT, SPECIALS[kind], "  two leading spaces", "x", ""]
    for text in texts:
        want = reference(text)["input_ids"]
        assert ours.encode(text) == want, text
        assert ours.decode(want) == reference.decode(want, skip_special_tokens=True), text
    # The sample really exercises the vocabulary: multi-character merges, byte
    # fallback or byte-level pieces, and every special token whole.
    ids = ours.encode(SPECIALS[kind])
    for special in ("<|im_start|>", "<|im_end|>", "<think>"):
        assert ours.tokenizer.token_to_id(special) in ids
    assert ours.add_bos == (kind == "llama")
    assert ours.eos_token == ("</s>" if kind == "llama" else "<|im_end|>")
    assert ours.stop_ids == {ours.tokenizer.token_to_id(ours.eos_token)}
    assert ours.chat_template == CHAT_TEMPLATE
    prompt = ours.render_chat([{"role": "user", "content": "Grüß dich"}])
    assert (
        ours.encode(prompt, chat=True) == reference(prompt, add_special_tokens=False)["input_ids"]
    )


def test_served_model_from_a_gguf_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "llama")
    served = ServedModel.load(str(path))
    assert served.name == "llama"
    assert served.context_length == 512  # the file's llama.context_length
    assert served.tokenizer.vocab_size == len(vocab_for("llama").tokens)


def test_byte_alphabet_is_gpt2s() -> None:
    table = byte_alphabet()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


def test_a_file_without_a_tokenizer_or_with_an_unknown_one_is_refused(tmp_path: Path) -> None:
    config = small_config().to_dict()
    bare = write_gguf(tmp_path / "bare.gguf", config, random_weights(small_config()))
    with pytest.raises(CheckpointError, match="no tokenizer in the GGUF metadata"):
        load_gguf_tokenizer(bare)
    vocab = vocab_for("qwen2")
    vocab_copy = type(vocab)(**{**vocab.__dict__, "pre": "mystery-pre"})
    odd = write_gguf(tmp_path / "odd.gguf", config, random_weights(small_config()),
                     vocab=vocab_copy)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"ggml\.pre 'mystery-pre' is not supported"):
        load_gguf_tokenizer(odd)

"""GGUF files (llama.cpp's format): ``file`` (the header), ``quants`` (decoding),
``config`` (metadata as a ``config.json`` dict), ``checkpoint`` (tensors under
their HF names) and ``tokenizer`` (the vocabulary as a ``tokenizers`` one)."""

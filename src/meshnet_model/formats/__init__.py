"""What is read from disk: ``config`` (a Hugging Face ``config.json``, fail-closed),
``safetensors`` (checkpoint directories, memory-mapped) and ``gguf`` (llama.cpp
files: header, quants, config, tensors, tokenizer). Imports only ``errors`` and
``rope`` of the rest of the package."""

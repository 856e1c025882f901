"""The gateway's OpenAI-compatible API over a chain of model stages.

``tokenizer`` (tokenizer.json + chat template), ``sampling`` (seeded
next-token choice), ``generation`` (prefill and decode through the chain),
``requests``/``errors`` (validation, OpenAI error bodies), ``api`` (the /v1
endpoints), ``testing`` (tiny tokenizers for tests).
"""

from meshnet_model.sampling import Sampler, SamplingParams

from .api import OPENAI_ROUTES, OpenAIService, ServedModel
from .tokenizer import ModelTokenizer

__all__ = [
    "OPENAI_ROUTES",
    "ModelTokenizer",
    "OpenAIService",
    "Sampler",
    "SamplingParams",
    "ServedModel",
]

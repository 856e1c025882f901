"""The gateway's view of the chain's prefix cache (wire-2 §3.10).

The gateway names every block of a generation's tokens (prompt and
generated) to the nodes, which file their KV under those keys. It keeps the
keys whose chunks the chain answered, most recently used last and bounded,
so that a new prompt starts after the longest prefix the chain is believed
to hold. Belief, not knowledge: a node may have evicted it since, and then
answers 409 ``prefix_unknown`` — the generation forgets the key and runs
the prompt cold (``ChainSession.prefill``). Counting only, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS
from meshnet_runtime.metrics import Sample

__all__ = ["PrefixIndex", "prefix_index_samples"]

DEFAULT_MAX_KEYS = 65536  # 16 bytes of key and an entry each: a few MiB at most


class PrefixIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.hits = 0
        self.misses = 0  # prompts with a whole block and none of it held
        self.refused = 0  # a node no longer held what we believed (cold rerun)
        self.tokens_saved = 0

    def add(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def longest(self, keys: Sequence[str], tokens: int) -> int:
        """How many leading blocks of a prompt of ``tokens`` ids (block keys
        ``keys``) to take from the cache: the longest held run of them that
        still leaves the prompt's last token to compute (its logits are the
        answer)."""
        usable = min(len(keys), (tokens - 1) // PREFIX_BLOCK_TOKENS)
        held = 0
        while held < usable and keys[held] in self._keys:
            held += 1
        for key in keys[:held]:
            self._keys.move_to_end(key)
        return held

    def discard_from(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def __len__(self) -> int:
        return len(self._keys)


def prefix_index_samples(index: PrefixIndex) -> list[Sample]:
    """The gateway's prefix-cache counts, for ``/metrics`` (``ReadAtScrape``)."""
    return [
        (
            "counter",
            "meshnet_gateway_prefix_hits",
            "Prompts started after a prefix the chain held",
            index.hits,
        ),
        (
            "counter",
            "meshnet_gateway_prefix_misses",
            "Prompts with a whole block and none of it held",
            index.misses,
        ),
        (
            "counter",
            "meshnet_gateway_prefix_refused",
            "Prompts rerun cold: a node no longer held the prefix",
            index.refused,
        ),
        (
            "counter",
            "meshnet_gateway_prefix_tokens_saved",
            "Prompt tokens the chain did not compute",
            index.tokens_saved,
        ),
        (
            "gauge",
            "meshnet_gateway_prefix_keys",
            "Block keys the chain is believed to hold",
            len(index),
        ),
    ]

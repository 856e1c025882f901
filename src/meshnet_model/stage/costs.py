"""What one chunk will cost a stage, computed from its shape before anything is allocated.

A chunk's header says ``[batch, tokens]``; everything the forward pass then
allocates follows from that and the config: the embedding (``rows x hidden``
float32), the attention scratch (queries, keys, values, and a score block of
``heads x 128 x context`` per batch row), the MLP's intermediate activations,
the logits of the last stage, and the KV cache's growth. ``ChunkCost`` adds
those up so a node can refuse a chunk from its head, before reading its
body, and so the limit a flag sets is a number of bytes a reader can check.

The figures are upper estimates of the peak working set of one layer (the
layers run one after another, so their scratch does not add up), not exact
allocator counts; they err on the large side.

The shapes come from ``ModelConfig`` (every family): ``head_dim`` is the
config's, not ``hidden / heads`` (qwen3 differs). A sliding window (mistral)
does not shrink the scores: both engines score every cached key and mask
the ones outside the window. Both engines score ``QUERY_BLOCK`` query rows at
once, in blocks aligned to absolute positions (``stage.batch.query_blocks``:
what makes a chunk's numbers independent of how a step split it); the engine
passes its ``query_block`` (``None``: the whole chunk at once). Float32 sizes
are used for both: torch's half-precision stages stay within them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.config import ModelConfig

__all__ = ["ChunkCost", "chunk_cost", "kv_bytes_per_position", "reachable_context"]

F32 = 4  # compute dtype's item size: everything is computed in float32
QUERY_BLOCK = 8  # query rows per attention block (stage.batch.ATTENTION_BLOCK)


@dataclass(frozen=True, slots=True)
class ChunkCost:
    rows: int  # batch x tokens
    embedding: int  # the hidden state of the chunk (a few live copies)
    attention: int  # q, k, v, the output and one score block
    mlp: int  # gate, up and their product
    logits: int  # the last stage's [batch, vocab]

    @property
    def total(self) -> int:
        """The peak scratch of one layer plus the hidden states around it."""
        return self.embedding + max(self.attention, self.mlp) + self.logits


def kv_bytes_per_position(config: ModelConfig, layers: int, batch: int) -> int:
    return 2 * layers * batch * config.num_key_value_heads * config.head_dim * F32


def reachable_context(
    config: ModelConfig, *, layers: int, batch: int, kv_budget: int, kv_itemsize: int = F32
) -> int:
    """The longest context a session can reach on a stage: the model's
    ``max_position_embeddings``, or fewer when the KV budget cannot hold that
    many positions (a Llama 3.2 has 131,072; a 1 GiB budget holds 16,384 of
    its 16 layers in float32). A chunk's scores are costed over this — not
    over positions no session can ever have — so a 128-token chunk of a
    long-context model is not refused for scratch it could never use."""
    per_position = 2 * layers * batch * config.num_key_value_heads * config.head_dim * kv_itemsize
    return max(1, min(config.max_position_embeddings, kv_budget // max(1, per_position)))


def chunk_cost(
    config: ModelConfig,
    *,
    batch: int,
    tokens: int,
    context: int,
    last: bool,
    query_block: int | None = QUERY_BLOCK,
) -> ChunkCost:
    """The cost of ``[batch, tokens]`` attending over ``context`` positions in all.

    Python ints throughout: a shape from a header may be absurd, and the
    product must be compared, not overflow.
    """
    rows = batch * tokens
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    # x, the normed h and the residual sum are alive at once.
    embedding = 3 * rows * config.hidden_size * F32
    qkv_out = rows * (2 * heads + 2 * kv_heads) * d * F32
    # One block of scores plus the causal mask over it (bool), per batch row;
    # the whole chunk is one block for an engine that scores it at once.
    block = tokens if query_block is None else min(tokens, query_block)
    scores = batch * heads * block * context * (F32 + 1)
    attention = qkv_out + scores
    mlp = 3 * rows * config.intermediate_size * F32
    logits = batch * config.vocab_size * F32 * 2 if last else 0  # norm + head output
    return ChunkCost(rows, embedding, attention, mlp, logits)

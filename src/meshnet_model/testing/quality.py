"""How far one engine's next-token distributions are from another's.

The quantized paths are not bit-exact, so they are held to an error budget
against the float32 dequantized reference (the numpy engine on the same
file): over every position of a teacher-forced sequence, the mean and the
largest KL divergence ``KL(reference || candidate)`` in nats, and the share
of positions whose top-1 token agrees. ``compare(reference, candidate, ids)``
takes two whole-model engines (``StageModel`` or ``TorchStageModel``, each
with ``score``) and token ids ``[1, tokens]``.

``PROSE`` is a text of our own (no download), long enough for 512+ positions
with a real tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stage.kv_cache import KVBudget

__all__ = ["PROSE", "Agreement", "compare", "log_softmax"]

PROSE = (
    "A pipeline splits a large language model into stages, and each stage runs on a "
    "machine of its own. The first stage turns token ids into vectors and runs the first "
    "layers; every later stage takes the hidden states of the one before it, runs its own "
    "layers and hands the result on, until the last stage turns the final hidden state "
    "into a distribution over the next token. Nothing in this arrangement is new: people "
    "have split networks across devices for as long as networks have been larger than "
    "devices. What matters is the detail. The hidden states must cross the network in a "
    "form that loses nothing, the stages must agree on where a sequence stands, and a "
    "machine that fails must not take a conversation with it.\n\n"
    "Memory is the reason to split at all. A model stored with four bits per weight is "
    "about an eighth of its size in single precision, and a stage that widens its share "
    "back to floats gives the saving away. So the weights stay in their blocks: a block "
    "holds thirty-two values, a scale and sometimes an offset, and the kernel that "
    "multiplies a vector by the matrix reads the blocks directly. Reading fewer bytes is "
    "also what makes decoding fast, because a decoding step reads every weight once and "
    "does very little arithmetic with each of them.\n\n"
    "The price of compact weights is a small error. It is measured rather than guessed: "
    "the same text is scored by the reference, which widens every block to single "
    "precision, and by the fast path, and the two distributions over the next token are "
    "compared at every position. The divergence between them is reported in nats, along "
    "with how often the most likely token is the same. A budget is written down, and a "
    "test fails when a change to a kernel spends more than the budget allows.\n\n"
    "Operators have their own concerns. They want to know before starting a node whether "
    "it will fit in the memory of the machine, and they want a clear sentence when it "
    "will not, not a process that the kernel kills without a word. They want the threads "
    "of two stages on one machine to share the cores instead of fighting over them. They "
    "want the defaults to be the fast and correct choice, and every setting that trades "
    "precision for speed to say so by name.\n\n"
    "The river ran brown after the storm, carrying branches and leaves past the mill. "
    "Children stood on the bridge and counted the logs as they went under, and an old "
    "man with a fishing rod told them which ones had come from the forest above the "
    "village. By evening the water had cleared, the sky was the colour of slate, and "
    "the baker lit the lamps in the square one by one, as he had done every night for "
    "forty years. Somewhere a dog barked twice and was quiet; the church clock struck "
    "seven, then, a little late, the clock at the station answered it."
)


@dataclass(frozen=True, slots=True)
class Agreement:
    positions: int
    kl_mean: float  # nats, mean over positions of KL(reference || candidate)
    kl_max: float
    top1: float  # share of positions whose argmax agrees

    def as_dict(self) -> dict[str, float]:
        return {
            "positions": self.positions,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1": self.top1,
        }


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def _score(engine: Any, ids: np.ndarray) -> np.ndarray:
    budget = KVBudget(1 << 40)
    cache = engine.new_cache(budget, ids.shape[0])
    try:
        scores: np.ndarray = np.asarray(engine.score(ids, cache))[0]
        return scores
    finally:
        cache.close()


def compare(reference: Any, candidate: Any, ids: np.ndarray) -> Agreement:
    """KL and top-1 agreement of ``candidate`` against ``reference`` at every position."""
    ref = log_softmax(_score(reference, ids))
    cand = log_softmax(_score(candidate, ids))
    kl = (np.exp(ref) * (ref - cand)).sum(axis=-1)
    top1 = float(np.mean(ref.argmax(-1) == cand.argmax(-1)))
    return Agreement(int(kl.shape[0]), float(kl.mean()), float(kl.max()), top1)

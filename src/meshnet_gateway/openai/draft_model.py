"""Drafters for the speculation loop (issue 38), and a draft model at the gateway.

``Drafter`` is what ``speculation.Speculator`` drafts through, per
generation: ``extend(ids)`` (the prompt, then each token taken or assumed
taken), ``await propose(k)`` (up to ``k`` tokens to follow), ``rewind(length)``
(forget the tokens past ``length``: a rejected window), ``len`` and
``close`` (the generation ended). ``LookupDrafter`` is prompt lookup
(``drafts.PromptLookup``), inline: no model, nothing to wait for.

``DraftModel`` (``--draft-model FILE.gguf``) is a small model with the
served model's tokenizer, run whole in the gateway process as one
``meshnet_model`` stage (the torch engine at the nodes' defaults when torch
is installed, held quantized; else numpy). Each generation drafts in one
session of it (``ModelDrafter``): its own KV cache, ``propose(k)`` ``k``
greedy one-token steps. The drafts are point masses, so the last stage's
verification keeps plain decoding's output bit for bit whatever they are
(``meshnet_model.speculative``): the draft model only decides how many
tokens a trip yields. Its compute runs in a worker thread.

Bounds: one session per generation, ended (its KV freed) when the
generation ends, cancelled or not; every session's KV under one budget,
``DRAFT_KV_CAP`` at most (see ``draft_kv_budget``). A generation whose
drafts do not fit (the budget is full, or past the draft model's context)
drafts nothing more: it goes on in plain steps, as it would with a lookup
that finds nothing.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

import anyio
import numpy as np

from meshnet_model import StageRunner
from meshnet_model.engines.choice import choose_engine
from meshnet_model.errors import KVBudgetExceeded, StageInputError
from meshnet_model.source import load_config, model_name
from meshnet_model.stage.costs import kv_bytes_per_position

from .drafts import PromptLookup
from .tokenizer import ModelTokenizer

__all__ = [
    "DRAFT_KV_CAP",
    "DraftModel",
    "Drafter",
    "LookupDrafter",
    "ModelDrafter",
    "draft_kv_budget",
    "draft_model_problem",
    "vocabulary_problem",
]

log = logging.getLogger("meshnet.gateway.openai")

# The draft model's KV, all sessions together: a node's default budget
# (``meshnet_model``'s 1 GiB). Below it, ``draft_kv_budget``'s product.
DRAFT_KV_CAP = 1024 * 1024 * 1024
# Tokens of one prefill step of the draft model: a long prompt goes in pieces
# of this many, well under the stage's --max-chunk-tokens and compute limits.
DRAFT_CHUNK = 512


class Drafter(Protocol):
    """One generation's drafts (see the module's docstring)."""

    def __len__(self) -> int: ...

    def extend(self, ids: Iterable[int]) -> None: ...

    def rewind(self, length: int) -> None: ...

    async def propose(self, k: int) -> list[int]: ...

    def close(self) -> None: ...


class LookupDrafter:
    """Prompt lookup as a ``Drafter``: a proposal is O(k) dict reads, made
    inline (no thread, no checkpoint)."""

    def __init__(self, lookup: PromptLookup) -> None:
        self.lookup = lookup

    def __len__(self) -> int:
        return len(self.lookup)

    def extend(self, ids: Iterable[int]) -> None:
        self.lookup.extend(ids)

    def rewind(self, length: int) -> None:
        self.lookup.rewind(length)

    async def propose(self, k: int) -> list[int]:
        return self.lookup.propose(k)

    def close(self) -> None:
        pass


def draft_kv_budget(per_position: int, sessions: int, context: int) -> int:
    """The draft model's KV budget: ``sessions`` generations (the gateway's
    ``--max-running``) of ``context`` positions each (the served context),
    capped at ``DRAFT_KV_CAP``. The cap is what binds for any real model
    (SmolLM2-135M: 45 KiB a position, so 1 GiB is ~23,000 positions, e.g. 11
    whole 2,048-token generations): a cache grows with the positions it
    holds, so the budget is a bound, never an allocation."""
    return max(per_position, min(DRAFT_KV_CAP, per_position * sessions * context))


class DraftModel:
    """The draft model of one gateway: one stage of all its layers, and the
    budget its sessions' KV shares."""

    def __init__(self, runner: StageRunner, *, path: str, vocab: int, engine: str) -> None:
        self.runner = runner
        self.path = path
        self.name = model_name(path)
        self.vocab = vocab  # ids past the served tokenizer's are never drafted
        self.engine = engine

    @classmethod
    def load(cls, path: str, *, vocab: int, sessions: int, context: int) -> DraftModel:
        """Read the model (``ValueError`` naming what is wrong); ``vocab``: the
        served tokenizer's size; ``sessions``/``context``: ``draft_kv_budget``'s."""
        config = load_config(path)
        layers = config.num_hidden_layers
        context = min(context, config.max_position_embeddings)
        budget = draft_kv_budget(kv_bytes_per_position(config, layers, 1), sessions, context)
        engine, dtype = choose_engine(path, "auto", "auto")  # as a node's --engine/--dtype auto
        if engine == "torch":
            from meshnet_model.engines.torch import load_torch_runner

            runner = load_torch_runner(
                path, None, dtype=dtype, kv_budget_bytes=budget, config=config
            )
        else:
            runner = StageRunner.load(path, None, dtype=dtype, kv_budget_bytes=budget)
        runner.prefix.limit = 0  # an ended session's KV goes at once: nothing is shared
        return cls(runner, path=path, vocab=vocab, engine=engine)

    def drafter(self, stop_ids: Collection[int]) -> ModelDrafter:
        """A new generation's drafter: a session of its own, until ``close``."""
        return ModelDrafter(self, stop_ids)

    def describe(self) -> dict[str, Any]:
        """For the gateway's ``/info``."""
        runner = self.runner
        return {
            "model": self.name,
            "path": self.path,
            "engine": self.engine,
            "layers": runner.config.num_hidden_layers,
            "kv_budget_bytes": runner.budget.limit,
            "kv_bytes_in_use": runner.kv_bytes_in_use,
            "sessions": runner.sessions,
        }


class ModelDrafter:
    """One generation's session of the draft model.

    ``extend`` and ``rewind`` keep the token history at once (a rewind drops
    the cache's positions past it, ``StageRunner.rewind``); the compute is
    ``propose``'s, in a worker thread: it first brings the cache up to the
    history (a prefill of the new ids — the prompt, the accepted tokens —
    reusing what the cache holds of it), then steps greedily. The cache
    then holds the history and every proposed token but the last, so when
    the caller extends by the proposal (a window sent), the next proposal
    computes one position before its own steps."""

    def __init__(self, model: DraftModel, stop_ids: Collection[int]) -> None:
        self.model = model
        self.stop_ids = frozenset(stop_ids)
        self.session = f"draft-{uuid.uuid4()}"
        self.ids: list[int] = []  # the history
        self.fed: list[int] = []  # the ids whose KV the session's cache holds
        self.next: int | None = None  # the greedy id after ``fed`` (None: not known)
        self.off = False  # drafts nothing more (see ``_give_up``)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, ids: Iterable[int]) -> None:
        self.ids.extend(ids)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"cannot rewind to {length}: the history holds {len(self.ids)}")
        del self.ids[length:]
        if len(self.fed) > length:
            self._truncate(length)

    async def propose(self, k: int) -> list[int]:
        """Up to ``k`` greedy tokens after the history; fewer at a stop id
        (the last one proposed); none after a stop id, or once the session
        gave up."""
        if self.off or k < 1 or not self.ids or self.ids[-1] in self.stop_ids:
            return []
        return await anyio.to_thread.run_sync(self._propose, k)

    def close(self) -> None:
        """End the session: its KV goes back to the budget."""
        self.off = True
        self.fed, self.next = [], None  # nothing held: a rewind has nothing to drop
        self.model.runner.end_session(self.session)

    # -- in the worker thread --------------------------------------------------------

    def _propose(self, k: int) -> list[int]:
        try:
            self._catch_up()
            out: list[int] = []
            while self.next is not None:
                out.append(self.next)
                if len(out) == k or self.next in self.stop_ids:
                    break
                self._feed([self.next])
            return out
        except (StageInputError, KVBudgetExceeded) as exc:  # past its context, budget full
            self._give_up(str(exc))
        except Exception:  # drafts are only guesses: a broken one must not fail the answer
            log.exception("draft model session %s failed", self.session)
            self._give_up("it failed")
        return []

    def _catch_up(self) -> None:
        """Make the cache hold the history (``fed == ids``) and ``next`` its
        greedy continuation."""
        ids, fed = self.ids, self.fed
        common = 0
        for a, b in zip(ids, fed, strict=False):
            if a != b:
                break
            common += 1
        if common == len(ids) == len(fed) and self.next is not None:
            return
        keep = min(common, len(ids) - 1)  # at least one id to run: its logits give ``next``
        if keep < len(fed):
            self._truncate(keep)
        # The last id alone, as the chain took the token its prefill drew: an
        # engine's bits may depend on how a sequence is cut into chunks, and
        # a near tie then goes the target's way more often.
        for start in range(keep, len(ids) - 1, DRAFT_CHUNK):
            self._feed(ids[start : min(start + DRAFT_CHUNK, len(ids) - 1)])
        self._feed(ids[-1:])

    def _feed(self, ids: list[int]) -> None:
        """Run ``ids`` at the cache's end; ``next`` from the last row's logits."""
        runner = self.model.runner
        logits = runner.run(self.session, len(self.fed), np.asarray([ids], dtype=np.int32))
        self.fed.extend(ids)
        # Ties to the lowest id, as the target's greedy draw (``np.argmax``).
        self.next = int(np.argmax(logits[0, : self.model.vocab]))

    def _truncate(self, length: int) -> None:
        self.model.runner.rewind(self.session, length)
        del self.fed[length:]
        self.next = None

    def _give_up(self, why: str) -> None:
        log.info("draft model session %s drafts no more: %s", self.session, why)
        self.close()


def vocabulary_problem(served: ModelTokenizer, draft: ModelTokenizer) -> str | None:
    """Why ``draft``'s vocabulary is not ``served``'s (token strings by id),
    naming the first id where they differ and both sizes; None when equal."""
    size_served, size_draft = served.vocab_size, draft.vocab_size
    for i in range(max(size_served, size_draft)):
        mine, theirs = draft.tokenizer.id_to_token(i), served.tokenizer.id_to_token(i)
        if mine != theirs:
            return (
                f"its vocabulary is not --model's: id {i} is {mine!r} here and {theirs!r} "
                f"there ({size_draft} tokens here, {size_served} there); a draft model "
                "must have the served model's tokenizer"
            )
    return None


def draft_model_problem(path: str, served: ModelTokenizer, speculate: str) -> str | None:
    """Why ``--draft-model PATH`` cannot serve beside ``served`` (one line,
    checked at start: the path, the config, the vocabulary); None if it can."""
    what = f"--draft-model {path}"
    if speculate == "off":
        return f"{what}: speculation is off (--speculate off); drop one of the two"
    if not os.path.exists(path):
        return f"{what}: no such file (give a .gguf file with --model's tokenizer)"
    if not os.access(path, os.R_OK):
        return f"{what}: not readable by this process"
    try:
        load_config(path)  # the nodes' fail-closed reading: a config it cannot run is refused
        draft = ModelTokenizer.load(Path(path))
    except (OSError, ValueError) as exc:
        return f"{what}: cannot load it: {exc}"
    problem = vocabulary_problem(served, draft)
    return None if problem is None else f"{what}: {problem}"

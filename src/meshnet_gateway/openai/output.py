"""A generation's output: its result, and its text and logprobs as they come
(to the result and to the caller's ``on_text``), and where it ends (``Tokens``:
stop ids, stop strings, ``max_tokens``), token by token whether a token came
from a plain decode step or from a verify window."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from meshnet_model.sampling import Sampler
from meshnet_proto import MeshnetError

from .drawn import Answer, Drawn
from .grammar import GrammarFailed, grammar_error
from .logprobs import TokenLogprob, TokenTexts
from .stops import StopFilter
from .tokenizer import ModelTokenizer, TextStream

if TYPE_CHECKING:
    from .generation import ChainSession

__all__ = ["GenerationResult", "OnText", "Output", "Tokens"]


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str = "length"  # "stop" (eos or a stop sequence) or "length"
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One entry per generated token shown (a stop id is not), when asked.
    logprobs: list[TokenLogprob] | None = None


# A piece of text and the logprobs of the tokens that came with it (None
# unless the request asked for logprobs; then a chunk is sent for every
# token, its text possibly empty, so each token's numbers arrive with it).
OnText = Callable[[str, "list[TokenLogprob] | None"], Awaitable[None]]


class Output:
    """A generation's text and logprobs, to its result and to ``on_text``."""

    def __init__(
        self,
        result: GenerationResult,
        on_text: OnText | None,
        tokenizer: ModelTokenizer,
        sampler: Sampler,
    ) -> None:
        self.result = result
        self.on_text = on_text
        self.sampler = sampler
        self.vocab = tokenizer.vocab_size
        wanted = sampler.params.logprobs is not None
        self.texts = TokenTexts(tokenizer) if wanted else None
        self.pending: list[TokenLogprob] = []  # entries not yet sent with a piece
        if wanted:
            result.logprobs = []

    def pick(self, answer: Answer) -> tuple[int, TokenLogprob | None]:
        """The next id and, if asked, its logprobs entry (in a worker thread):
        drawn from the logits here, or as the last stage drew it."""
        sampler = self.sampler
        if isinstance(answer, Drawn):
            token = answer.token
            if token >= self.vocab:  # a forged id would decode to nothing, silently
                raise ValueError(f"the drawn id {token} is past the vocabulary ({self.vocab})")
            try:
                sampler.record(answer.logprobs, token)
            except GrammarFailed:  # the mask it was sent did not allow it
                raise ValueError(f"the drawn id {token} is not one the mask allowed") from None
        else:
            token = sampler(answer)
        if self.texts is None or sampler.last is None or token in sampler.stop_ids:
            return token, None
        return token, self.texts.entry(sampler.last)

    async def choose(self, answer: Answer, chain: ChainSession) -> tuple[int, TokenLogprob | None]:
        """``pick``, off the event loop when it is O(vocab) numpy work."""
        try:
            if isinstance(answer, Drawn):  # nothing to compute: no thread hop
                return self.pick(answer)
            return await anyio.to_thread.run_sync(self.pick, answer)
        except GrammarFailed as exc:
            # The request's grammar, not the chain: out of its per-step fuel.
            raise grammar_error(exc) from None
        except ValueError as exc:  # e.g. every logit NaN: the last stage is broken
            url = chain.pool.url
            raise MeshnetError(
                f"{url}: the last stage's logits cannot be sampled: {exc}",
                code="downstream_bad_response",
                status=502,
                hop=url,
            ) from None

    def add(self, entry: TokenLogprob | None) -> None:
        if entry is not None and self.result.logprobs is not None:
            self.pending.append(entry)
            self.result.logprobs.append(entry)

    async def emit(self, piece: str) -> None:
        self.result.text += piece
        if self.texts is None:
            if piece and self.on_text is not None:
                await self.on_text(piece, None)
            return
        shown, self.pending = self.pending, []
        if (piece or shown) and self.on_text is not None:
            await self.on_text(piece, shown)


class Tokens:
    """The generated tokens, one at a time, until the generation ends: at a
    stop id (counted, not shown), a stop string, or ``max_tokens``.

    The sampler's stop ids are read here, so ``Sampler.begin`` comes first.
    ``on_token`` is told of each token as it is taken (the request's timing).
    """

    def __init__(
        self,
        output: Output,
        tokenizer: ModelTokenizer,
        stop: Sequence[str],
        max_tokens: int,
        on_token: Callable[[], None] | None = None,
    ) -> None:
        self.output = output
        self.max_tokens = max_tokens
        self.on_token = on_token
        self.stream = TextStream(tokenizer)
        self.stops = StopFilter(stop)
        self.stop_ids = output.sampler.stop_ids
        self.produced = 0
        self.stopped = False  # a stop id or a stop string ended it

    @property
    def remaining(self) -> int:
        """Tokens the generation may still take."""
        return self.max_tokens - self.produced

    async def take(self, token: int, entry: TokenLogprob | None) -> bool:
        """One more token (and its logprobs entry): whether the generation has ended."""
        result = self.output.result
        self.produced += 1
        result.completion_tokens = self.produced
        if self.on_token is not None:
            self.on_token()
        if token in self.stop_ids:
            self.stopped = True
            return True
        result.token_ids.append(token)
        self.output.add(entry)
        text, self.stopped = self.stops.feed(self.stream.push(token))
        await self.output.emit(text)
        return self.stopped or self.produced >= self.max_tokens

    async def finish(self) -> None:
        """The text held back (an unfinished character, a stop string's
        possible start) and the finish reason, once no token comes any more."""
        emit = self.output.emit
        if not self.stopped:
            text, self.stopped = self.stops.feed(self.stream.flush())
            await emit(text)
            if not self.stopped:
                await emit(self.stops.flush())
        self.output.result.finish_reason = "stop" if self.stopped else "length"

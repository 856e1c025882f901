"""Driving one generation through the chain: chunked prefill, then decode steps.

A generation owns one session on the nodes. The prompt's ids (``int32``,
``[1, tokens]``) go down as one run of chunks of ``chunk_tokens`` with up to
``inflight`` on the wire, as any gateway run (``plan_chunks``, one encode
ahead, first failure wins); the last stage answers every chunk with the
logits of its last position (``[1, vocab]``), and only the last chunk's
answer matters. Each generated token is then one new run of one chunk
``[1, 1]`` at the session's position: the nodes' KV caches continue the
context. When the generation ends — finished, failed or cancelled because
the client left — the session is deleted at the entry node, which passes
the DELETE down the chain.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np

from meshnet_proto import ErrorResponse, MeshnetError, WireHeaders
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, blocks_ending_in, prefix_block_keys
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, key_headers
from meshnet_runtime.wire_encoder import WireEncoder

from .._pipeline import run_chunks
from .._retry import RetryPolicy
from .logprobs import TokenLogprob, TokenTexts
from .metrics import GenerationMetrics
from .prefix_index import PrefixIndex
from .sampling import Sampler
from .tokenizer import ModelTokenizer, TextStream

__all__ = [
    "ChainSession",
    "ChainSettings",
    "GenerationResult",
    "StopFilter",
    "generate",
]

log = logging.getLogger("meshnet.gateway.openai")

# The DELETE that frees a finished generation's KV cache: bounded, so a hung
# node costs the request at most this long (the nodes' TTL frees the rest).
DELETE_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainSettings:
    chunk_tokens: int
    inflight: int
    encoding: str  # the gateway's --encoding policy
    zstd_level: int
    timeout: float  # one chain call (a prefill, or one decode step)
    # Lost connections and 502/503/504 are retried as on the wire-2 path
    # (--retries): every chunk carries session and position, so a node that
    # already ran it replays its answer (wire-2 §3) and no KV entry is doubled.
    retry: RetryPolicy | None = None
    # X-Meshnet-Stage for the entry (the gateway's ``expected_entry``), and
    # who to tell when a node answers that it is not the stage expected.
    stage: str | None = None
    on_stage_mismatch: Callable[[], None] | None = None
    # The chain's prefix cache (wire-2 §3.10): what it is believed to hold;
    # None sends no block keys at all (--no-prefix-cache).
    prefix: PrefixIndex | None = None


class ChainSession:
    """One session on the chain: its position advances with every token sent."""

    def __init__(
        self,
        pool: Downstream,
        codecs: CodecPool,
        settings: ChainSettings,
        *,
        metrics: GenerationMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.codecs = codecs
        self.settings = settings
        self.metrics = metrics
        # Fixed per request: --encoding as set (auto here is the core's
        # content-based choice; ids and single tokens are small anyway).
        self.encoder = WireEncoder(codecs, encoding=settings.encoding, level=settings.zstd_level)
        self.runs = 0  # runs completed: prefill + decode steps
        self.prefix = settings.prefix
        self._new_session()

    def _new_session(self) -> None:
        self.session = str(uuid.uuid4())
        # Internal sessions are keyed too (wire-2 §3.9): only this gateway
        # can go on with, or end, one of its generations on the nodes.
        self.key = secrets.token_hex(16)
        self.position = 0
        # Chunks handed to the wire, all runs together: counted before they
        # go, so that a prefill cancelled halfway is still deleted.
        self.chunks = 0
        # Every id the session holds, and the keys of its whole blocks (§3.10).
        self.history: list[int] = []
        self.block_keys: list[str] = []
        self.tokens_saved = 0

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Send the prompt; the logits after its last token (``[vocab]``).

        With a prefix index, the prompt starts after the longest prefix of it
        the chain is believed to hold; a node that no longer holds it answers
        409 ``prefix_unknown``, and the prompt runs again cold in a new session.
        """
        started = time.perf_counter()
        ids = [int(i) for i in ids]
        logits = None
        if self.prefix is not None and self.position == 0:
            keys = prefix_block_keys(ids)
            held = self.prefix.longest(keys, len(ids))
            if held:
                logits = await self._attached(ids, keys, held)
            elif keys:
                self.prefix.misses += 1
        if logits is None:
            logits = await self._run(np.asarray([ids], dtype=np.int32))
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        return logits

    async def _attached(self, ids: list[int], keys: list[str], held: int) -> np.ndarray | None:
        """Run the prompt after its first ``held`` cached blocks; None if a node refused."""
        assert self.prefix is not None
        start = held * PREFIX_BLOCK_TOKENS
        self.history, self.block_keys, self.position = ids[:start], keys[:held], start
        try:
            logits = await self._run(
                np.asarray([ids[start:]], dtype=np.int32), attach=keys[held - 1]
            )
        except MeshnetError as exc:
            if exc.code != "prefix_unknown":
                raise
            self.prefix.refused += 1
            self.prefix.discard_from(keys[held - 1 :])
            await self.close()
            self._new_session()
            return None
        self.prefix.hits += 1
        self.prefix.tokens_saved += start
        self.tokens_saved = start
        return logits

    async def step(self, token_id: int) -> np.ndarray:
        """One decode step: the logits after ``token_id``."""
        started = time.perf_counter()
        logits = await self._run(np.asarray([[token_id]], dtype=np.int32))
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - started)
        return logits

    async def _run(self, ids: np.ndarray, *, attach: str | None = None) -> np.ndarray:
        """One run of chunks; the last stage's answer to the last chunk.
        ``attach``: the cached prefix the session's first chunk starts from."""
        settings = self.settings

        def count(headers: WireHeaders) -> None:
            self.chunks += 1

        annotate = None
        if self.prefix is not None:
            annotate = self._block_keys_for(ids, attach)

        try:
            result = await run_chunks(
                self.pool,
                self.encoder,
                ids,
                session=self.session,
                session_key=self.key,
                base_position=self.position,
                chunk_tokens=settings.chunk_tokens,
                inflight=max(1, settings.inflight),
                deadline=Deadline.after(settings.timeout),
                retry=settings.retry,
                on_send=count,
                last_only=True,
                stage=settings.stage,
                annotate=annotate,
            )
        except MeshnetError as exc:
            if exc.code == "stage_mismatch" and settings.on_stage_mismatch is not None:
                settings.on_stage_mismatch()  # the chain changed under us: re-check it
            raise
        finally:
            # Whatever reached the nodes is in their caches now: the position
            # moves even on failure, though a failed session is only deleted.
            self.position += ids.shape[1]
            self.runs += 1
        if self.prefix is not None:  # every chunk answered: the chain holds these
            self.prefix.add(self.block_keys)
        logits = result.output
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise MeshnetError(
                f"{self.pool.url}: the last stage answered shape {logits.shape}, "
                "not logits [1, vocab]",
                code="downstream_bad_response",
                status=502,
                hop=self.pool.url,
            )
        return np.asarray(logits[0], dtype=np.float32)

    def _block_keys_for(
        self, ids: np.ndarray, attach: str | None
    ) -> Callable[[WireHeaders], WireHeaders]:
        """Extend the session's block keys by ``ids``; what adds each chunk's
        ``X-Meshnet-Prefix-Blocks`` (and the first's ``X-Meshnet-Prefix``)."""
        done = len(self.block_keys) * PREFIX_BLOCK_TOKENS
        self.history.extend(int(i) for i in ids.reshape(-1))
        previous = self.block_keys[-1] if self.block_keys else None
        self.block_keys += prefix_block_keys(self.history[done:], previous)
        keys = self.block_keys

        def annotate(headers: WireHeaders) -> WireHeaders:
            position = headers.position or 0
            first = position // PREFIX_BLOCK_TOKENS
            blocks = tuple(keys[first : first + blocks_ending_in(position, headers.tokens)])
            prefix = attach if headers.chunk_index == 0 else None
            if prefix is None and not blocks:
                return headers
            return headers.replace(prefix=prefix, prefix_blocks=blocks)

        return annotate

    async def close(self) -> None:
        """Free the session on every node (the entry passes the DELETE down).

        Shielded and bounded: it runs in ``finally`` blocks of cancelled
        requests, and a node that cannot be reached is left to its TTL.
        """
        if self.chunks == 0:
            return  # no chunk went out: no node holds this session
        with anyio.CancelScope(shield=True):
            try:
                response = await self.pool.request(
                    "DELETE",
                    f"/sessions/{self.session}",
                    Deadline.after(DELETE_TIMEOUT),
                    key_headers(self.key),
                )
            except MeshnetError as exc:
                log.warning("DELETE /sessions/%s failed: %s", self.session, exc)
                return
            if isinstance(response, ErrorResponse) and response.status != 404:
                log.warning("DELETE /sessions/%s: %d", self.session, response.status)


class StopFilter:
    """Cuts generated text at the first stop sequence.

    Text that might be the start of a stop sequence is held back until the
    next piece shows whether it is one, so a stop sequence split across
    tokens never reaches the client.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop sequence was reached)."""
        text = self._pending + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self._pending = ""
            return text[: min(found)], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest


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


class _Output:
    """A generation's text and logprobs, to its result and to ``on_text``."""

    def __init__(self, result: GenerationResult, on_text: OnText | None,
                 tokenizer: ModelTokenizer, sampler: Sampler) -> None:  # fmt: skip
        self.result = result
        self.on_text = on_text
        self.sampler = sampler
        wanted = sampler.params.logprobs is not None
        self.texts = TokenTexts(tokenizer) if wanted else None
        self.pending: list[TokenLogprob] = []  # entries not yet sent with a piece
        if wanted:
            result.logprobs = []

    def pick(self, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next id and, if asked, its logprobs entry (in a worker thread)."""
        sampler = self.sampler
        token = sampler(logits)
        if self.texts is None or sampler.last is None or token in sampler.stop_ids:
            return token, None
        return token, self.texts.entry(sampler.last)

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


async def generate(
    chain: ChainSession,
    tokenizer: ModelTokenizer,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    sampler: Sampler,
    stop: Sequence[str] = (),
    on_text: OnText | None = None,
    on_prefilled: Callable[[], None] | None = None,
    on_token: Callable[[], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_tokens`` after ``prompt_ids``; ``on_text`` gets each new piece.

    Generation ends at the sampler's stop ids (the model's eos ids unless
    ``ignore_eos``, and ``stop_token_ids``), masked by the sampler until
    ``min_tokens`` tokens exist.
    ``on_prefilled``: called once the prompt's last chunk is answered (the
    admission control's prefill budget gets the prompt's tokens back then).
    ``on_token``: called as each token is sampled (a stop id too: it counts
    in ``completion_tokens``), for the request's timing (TTFT, inter-token).
    Does not close ``chain``: the caller does, in a ``finally``.
    """
    result = GenerationResult(prompt_tokens=len(prompt_ids))
    if max_tokens == 0:
        return result
    stream = TextStream(tokenizer)
    stops = StopFilter(stop)
    sampler.begin(prompt_ids, tokenizer.stop_ids)
    stop_ids = sampler.stop_ids
    output = _Output(result, on_text, tokenizer, sampler)
    emit = output.emit
    logits = await chain.prefill(prompt_ids)
    if on_prefilled is not None:
        on_prefilled()
    stopped = False
    for produced in range(1, max_tokens + 1):
        try:
            # O(vocab) numpy work per token: off the event loop.
            token, entry = await anyio.to_thread.run_sync(output.pick, logits)
        except ValueError as exc:  # e.g. every logit NaN: the last stage is broken
            raise MeshnetError(
                f"{chain.pool.url}: the last stage's logits cannot be sampled: {exc}",
                code="downstream_bad_response",
                status=502,
                hop=chain.pool.url,
            ) from None
        result.completion_tokens = produced
        if on_token is not None:
            on_token()
        if token in stop_ids:
            stopped = True
            break
        result.token_ids.append(token)
        output.add(entry)
        text, stopped = stops.feed(stream.push(token))
        await emit(text)
        if stopped or produced == max_tokens:
            break  # the last token needs no decode step of its own
        logits = await chain.step(token)
    if not stopped:
        text, stopped = stops.feed(stream.flush())
        await emit(text)
        if not stopped:
            await emit(stops.flush())
    result.finish_reason = "stop" if stopped else "length"
    return result

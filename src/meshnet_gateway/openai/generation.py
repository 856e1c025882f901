"""Driving one generation through the chain: chunked prefill, then decode steps.

A generation owns one session on the nodes. The prompt's ids (``int32``,
``[1, tokens]``) go down as one run of chunks of ``chunk_tokens`` with up to
``inflight`` on the wire, as any gateway run (``plan_chunks``, one encode
ahead, first failure wins); the last stage answers every chunk with the
logits of its last position (``[1, vocab]``), and only the last chunk's
answer matters. Each generated token is then one new run of one chunk
``[1, 1]`` at the session's position: the nodes' KV caches continue the
context. A decode step is one prebuilt request (no chunk plan, task group or
assembler for one token).

Where the token is drawn (wire-2 §3.13): while the sampler needs nothing but
the logits, its parameters and ``(seed, position)`` (``Sampler.stateless``),
the run's last chunk carries ``X-Meshnet-Sample`` and the last stage answers
the drawn id, not the ``[1, vocab]`` logits; otherwise (``logit_bias``, the
penalties, a ``min_tokens`` mask in force, ``--sample-at gateway``) the
logits come up and the gateway draws, with the same function: either way the
same tokens. A chain that ignores the header (older nodes) answers logits,
and the gateway draws from them. With ``--speculate lookup`` the decode
steps become verify windows of several drafted tokens where drafting pays
(``speculation.py``, wire-2 §3.16). When the generation ends — finished,
failed or cancelled because the client left — the session is deleted at the
entry node, which passes the DELETE down the chain.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import overload

import anyio
import numpy as np

from meshnet_model.sampling import Sampler
from meshnet_proto import ErrorResponse, MeshnetError, WireHeaders
from meshnet_proto.lowlevel import (
    PREFIX_BLOCK_TOKENS,
    SampleSpec,
    blocks_ending_in,
    prefix_block_keys,
)
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream, key_headers
from meshnet_runtime.wire_encoder import WireEncoder

from .._pipeline import check_response, run_chunks
from .._retry import RetryPolicy, send_with_retries
from ..tenancy import Tenancy
from .chunk_marks import marked, sampling_last
from .direct_return import DirectReturn, Pipeline, pipelined
from .drawn import Answer, Drawn, read_answer, spec_for_last_stage
from .metrics import GenerationMetrics
from .output import GenerationResult, OnText, Output, Tokens
from .pieces import PrefillGate, run_in_pieces
from .prefix_index import PrefixIndex
from .session_lines import Lines
from .speculation import Speculate, decode
from .stops import StopFilter
from .tokenizer import ModelTokenizer

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
    # Who draws the tokens (wire-2 §3.13): the last stage while it can
    # ("last-stage"), or always the gateway from relayed logits ("gateway").
    sample_at: str = "last-stage"
    # The last stage as this gateway reaches it, polled for each decode
    # step's token (wire-2 §3.14); None: every answer comes relayed.
    direct: DirectReturn | None = None
    # Verify windows of drafted tokens (wire-2 §3.16); None: one token a step.
    speculate: Speculate | None = None


class ChainSession:
    """One session on the chain: its position advances with every token sent."""

    def __init__(
        self,
        pool: Downstream,
        codecs: CodecPool,
        settings: ChainSettings,
        *,
        metrics: GenerationMetrics | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        self.pool = pool
        # Whom the session serves (wire-2 §3.15): on its prefill's chunks.
        self.tenancy = tenancy
        self.salt = tenancy.cache_salt if tenancy is not None else None
        self.codecs = codecs
        self.settings = settings
        self.metrics = metrics
        # Fixed per request: --encoding as set (auto here is the core's
        # content-based choice; ids and single tokens are small anyway).
        self.encoder = WireEncoder(codecs, encoding=settings.encoding, level=settings.zstd_level)
        self.runs = 0  # runs completed: prefill + decode steps
        self.prefix = settings.prefix
        # A generation's relays in flight, while it runs pipelined (§3.14).
        self.pipeline: Pipeline | None = None
        self.gate: PrefillGate | None = None  # set: a prompt goes in pieces (pieces.py)
        self.drafted = self.accepted = 0  # this generation's window tokens (the access line)
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
        self.lines = Lines()  # what the nodes hold past ``position``, and rewinds

    async def restart(self) -> None:
        """End this session on the nodes and go on in a new, empty one."""
        await self.close()
        self._new_session()

    def keep(self, ids: Sequence[int]) -> None:
        """A window's accepted part: the session holds ``ids`` (blocks never
        filed: windows carry no block keys, wire-2 §3.16)."""
        if self.prefix is not None:
            start = len(self.block_keys)
            self._block_keys_for(np.asarray([ids], dtype=np.int32), None)
            self.lines.unfiled.update(self.block_keys[start:])
        self.position += len(ids)
        self.lines.ahead -= len(ids)

    @overload
    async def prefill(self, ids: Sequence[int], sample: None = None) -> np.ndarray: ...
    @overload
    async def prefill(self, ids: Sequence[int], sample: SampleSpec | None) -> Answer: ...
    async def prefill(self, ids: Sequence[int], sample: SampleSpec | None = None) -> Answer:
        """Send the prompt; the logits after its last token (``[vocab]``), or
        with ``sample`` the token the last stage drew there (wire-2 §3.13).

        With a prefix index, the prompt starts after the longest prefix of it
        the chain is believed to hold; a node that no longer holds it answers
        409 ``prefix_unknown``, and the prompt runs again cold in a new session.
        """
        started = time.perf_counter()
        ids = [int(i) for i in ids]
        logits = None
        if self.prefix is not None and self.position == 0:
            keys = prefix_block_keys(ids, salt=self.salt)
            held = self.prefix.longest(keys, len(ids))
            if held:
                logits = await self._attached(ids, keys, held, sample)
            elif keys:
                self.prefix.misses += 1
        if logits is None:
            logits = await self._run(np.asarray([ids], dtype=np.int32), sample=sample)
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        return logits

    async def _attached(
        self, ids: list[int], keys: list[str], held: int, sample: SampleSpec | None
    ) -> Answer | None:
        """Run the prompt after its first ``held`` cached blocks; None if a node refused."""
        assert self.prefix is not None
        start = held * PREFIX_BLOCK_TOKENS
        self.history, self.block_keys, self.position = ids[:start], keys[:held], start
        try:
            logits = await self._run(
                np.asarray([ids[start:]], dtype=np.int32), attach=keys[held - 1], sample=sample
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

    @overload
    async def step(self, token_id: int, sample: None = None) -> np.ndarray: ...
    @overload
    async def step(self, token_id: int, sample: SampleSpec | None) -> Answer: ...
    async def step(self, token_id: int, sample: SampleSpec | None = None) -> Answer:
        """One decode step: the logits after ``token_id``, or with ``sample``
        the token the last stage drew after it.

        One prebuilt request, sent and retried as a run's chunk is, without
        a run's machinery (a chunk plan, a task group, an assembler)."""
        started = time.perf_counter()
        ids = np.asarray([[token_id]], dtype=np.int32)
        settings = self.settings
        headers = WireHeaders(
            shape=(1, 1),
            dtype="int32",
            session=self.session,
            chunk_index=0,
            chunk_total=1,
            position=self.position,
            stage=settings.stage,
            session_key=self.key,
            sample=sample,
            after=self.lines.plain(self.position),
        )
        if self.prefix is not None:
            headers = self._block_keys_for(ids, None)(headers)
        self.chunks += 1
        deadline = Deadline.after(settings.timeout)
        direct, pipeline = settings.direct, self.pipeline
        if (
            direct is not None
            and pipeline is not None
            and sample is not None
            and direct.worth_polling(probe=self.runs == 1)  # a generation's first step
        ):
            answer = await self._step_direct(direct, pipeline, headers, ids, sample, deadline)
        else:
            try:
                tensor = await self._send_step(headers, ids, deadline)
            finally:
                self.position += 1
                self.runs += 1
            answer = read_answer(tensor, sample, self.pool.url)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - started)
        return answer

    async def _send_step(
        self, headers: WireHeaders, ids: np.ndarray, deadline: Deadline
    ) -> np.ndarray:
        """One step down the chain and its relayed answer, decoded."""
        try:
            response = await send_with_retries(
                self.pool, headers, ids.tobytes(), deadline, self.settings.retry
            )
            check_response(self.pool, headers, response.headers)
            tensor = await self.codecs.decode(response.headers, response.body)
        except MeshnetError as exc:
            self.suspect(exc)
            raise
        if self.prefix is not None:
            self.prefix.add(self.lines.filed(self.block_keys))
        return tensor

    async def _step_direct(
        self,
        direct: DirectReturn,
        pipeline: Pipeline,
        headers: WireHeaders,
        ids: np.ndarray,
        sample: SampleSpec,
        deadline: Deadline,
    ) -> Answer:
        """wire-2 §3.14: the step goes down the chain, its token is asked of
        the last stage at once; the relayed answer lands in the background
        and must agree with it."""
        pipeline.raise_failure()  # an earlier step's relay failed: stop here
        url = self.pool.url

        def agree(relayed: np.ndarray, early: np.ndarray) -> None:
            # The poll is answered the chunk's own 200 (§3.14): the same
            # tensor, bit for bit; ``early`` was read and checked already.
            if relayed.dtype != early.dtype or not np.array_equal(relayed, early):
                raise MeshnetError(
                    f"{url}: the relayed answer names another token than the last "
                    f"stage's direct one ({direct.url})",
                    code="downstream_bad_response",
                    status=502,
                    hop=url,
                )

        relay = pipeline.start(
            lambda: self._send_step(headers, ids, deadline), agree, direct.observe_lag
        )
        self.position += 1
        self.runs += 1
        early = await direct.poll(headers, self.key, deadline)
        if early is not None:
            answer = read_answer(early, sample, direct.url)
            if isinstance(answer, Drawn):
                relay.took(early)
                return answer
        return read_answer(await relay.result(), sample, url)

    @asynccontextmanager
    async def pipelined(self) -> AsyncIterator[None]:
        """Decode steps may leave before the previous step's relayed answer
        is back (the direct return, wire-2 §3.14); every relay lands, or its
        failure is raised, before the block ends."""
        async with pipelined() as pipeline:
            self.pipeline = pipeline
            try:
                yield
            finally:
                self.pipeline = None

    def suspect(self, exc: MeshnetError) -> None:
        if exc.code == "stage_mismatch" and self.settings.on_stage_mismatch is not None:
            self.settings.on_stage_mismatch()  # the chain changed under us: re-check it

    async def _run(
        self, ids: np.ndarray, *, attach: str | None = None, sample: SampleSpec | None = None
    ) -> Answer:
        """``_run_once``, or with a gate one run per granted piece."""
        if self.gate is None:
            return await self._run_once(ids, attach=attach, sample=sample)
        window = self.settings.chunk_tokens * max(1, self.settings.inflight)
        return await run_in_pieces(self._run_once, ids, window, self.gate, attach, sample)

    async def _run_once(
        self, ids: np.ndarray, *, attach: str | None = None, sample: SampleSpec | None = None
    ) -> Answer:
        """One run of chunks; the last stage's answer to the last chunk.
        ``attach``: the cached prefix the session's first chunk starts from;
        ``sample``: how the last stage draws after the last chunk."""
        settings = self.settings

        def count(headers: WireHeaders) -> None:
            self.chunks += 1

        annotate = None
        if self.prefix is not None:
            annotate = self._block_keys_for(ids, attach)
        if sample is not None:
            annotate = sampling_last(annotate, sample)
        if self.tenancy is not None:
            annotate = marked(annotate, self.tenancy)

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
            self.suspect(exc)
            raise
        finally:
            # Whatever reached the nodes is in their caches now: the position
            # moves even on failure, though a failed session is only deleted.
            self.position += ids.shape[1]
            self.runs += 1
        if self.prefix is not None:  # every chunk answered: the chain holds these
            self.prefix.add(self.lines.filed(self.block_keys))
        return read_answer(result.output, sample, self.pool.url)

    def _block_keys_for(
        self, ids: np.ndarray, attach: str | None
    ) -> Callable[[WireHeaders], WireHeaders]:
        """Extend the session's block keys by ``ids``; what adds each chunk's
        ``X-Meshnet-Prefix-Blocks`` (and the first's ``X-Meshnet-Prefix``)."""
        done = len(self.block_keys) * PREFIX_BLOCK_TOKENS
        self.history.extend(int(i) for i in ids.reshape(-1))
        previous = self.block_keys[-1] if self.block_keys else None
        self.block_keys += prefix_block_keys(self.history[done:], previous, salt=self.salt)
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
    sample_at: str = "last-stage",
    speculate: Speculate | None = None,
) -> GenerationResult:
    """Generate up to ``max_tokens`` after ``prompt_ids``; ``on_text`` gets each new piece.

    ``sample_at``: "last-stage" asks the chain to draw while the sampler is
    stateless (wire-2 §3.13; a chain that answers logits anyway is drawn
    from here), "gateway" never does. ``speculate``: decode steps become
    verify windows where drafting pays (``speculation.py``).

    Generation ends at the sampler's stop ids (the model's eos ids unless
    ``ignore_eos``, and ``stop_token_ids``), masked by the sampler until
    ``min_tokens`` tokens exist.
    ``on_prefilled``: called once the prompt's last chunk is answered.
    ``on_token``: called as each token is sampled (a stop id too: it counts
    in ``completion_tokens``), for the request's timing (TTFT, inter-token).
    Does not close ``chain``: the caller does, in a ``finally``.
    """
    result = GenerationResult(prompt_tokens=len(prompt_ids))
    if max_tokens == 0:
        return result
    sampler.begin(prompt_ids, tokenizer.stop_ids)
    output = Output(result, on_text, tokenizer, sampler)
    tokens = Tokens(output, tokenizer, stop, max_tokens, on_token)
    remote = sample_at == "last-stage"
    async with chain.pipelined():  # the direct return's relays land inside (§3.14)
        sample = await spec_for_last_stage(sampler) if remote else None
        answer = await chain.prefill(prompt_ids, sample)
        if on_prefilled is not None:
            on_prefilled()
        # A chain that answered logits where a token was asked draws nothing
        # (wire-2 §3.13), so it verifies nothing either (§3.16).
        if not remote or (sample is not None and not isinstance(answer, Drawn)):
            speculate = None
        await decode(chain, output, tokens, answer, prompt_ids, remote, speculate)
    await tokens.finish()
    return result

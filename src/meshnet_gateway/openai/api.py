"""The OpenAI-compatible surface of the gateway: /v1/models, /v1/completions,
/v1/chat/completions (plain JSON or server-sent events).

``OpenAIService.handle`` takes a complete ``EndpointRequest`` and returns the
answer: a JSON ``Reply`` or, for ``stream: true``, a ``StreamReply`` whose
producer runs the generation while the events are written. Every request
owns one chain session, deleted on every node when the request ends:
finished, failed, or cancelled because the client disconnected.

Nothing user-sized runs on the event loop (issue 13): parsing the JSON,
checking it, rendering the chat template and tokenizing happen in a worker
thread (``_prepare``, at most ``PREPARE_THREADS`` at once), after a
character cap that bounds what the tokenizer is given; sampling runs in a
worker thread too (``generation.generate``). A refused request is answered
with the OpenAI error body and logged in one line, without a traceback.

A checked request then passes the gateway's admission control
(``meshnet_gateway.admission``) before any chunk goes down the chain: it
starts, waits its turn in a queue fair across clients, or is refused with
429 ``queue_full`` / 503 ``queue_timeout`` and ``Retry-After``; its prompt
then goes down in pieces, each granted prefill budget in turn (issue 37).
Its ticket is given back on every way the generation ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

from meshnet_model.sampling import Sampler
from meshnet_proto import EndpointRequest, MeshnetError
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import Downstream
from meshnet_runtime.http_server import Reply, StreamReply, StreamSend

from ..admission import Admission, Ticket
from ..tenancy import Tenancy
from .admitted import admission_gate, admit
from .choices import choice_seed, run_choices
from .errors import OpenAIError, from_meshnet, invalid
from .formats import ChatFormat as _ChatFormat
from .formats import CompletionFormat as _CompletionFormat
from .formats import Format as _Format
from .generation import ChainSession, ChainSettings, generate
from .grammar import Grammar, GrammarCompiler
from .limits import MAX_MESSAGES, PromptLimits, checked_text, shown
from .messages import check_names
from .metrics import GenerationMetrics, ServingMetrics
from .output import GenerationResult, OnText
from .request_grammar import request_grammar
from .requests import (
    ChatRequest,
    CompletionRequest,
    GenerationOptions,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from .served_model import ServedModel
from .special_tokens import ChatEncoder
from .streamed import SSE_HEADERS, SSE_HEARTBEAT, OpenStreams, stream_events
from .timing import RequestTiming
from .tokenizer import ChatTemplateError
from .tool_prompt import ToolPrompt
from .unknown import UNKNOWN_METHODS, UNKNOWN_ROUTE, unknown_path

__all__ = ["OPENAI_ROUTES", "OpenAIService", "ServedModel"]

log = logging.getLogger("meshnet.gateway.openai")

OPENAI_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/models": ("GET",),
    "/v1/models/*": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    UNKNOWN_ROUTE: UNKNOWN_METHODS,
}
# A chat request carries the conversation: far more than a control body.
MAX_REQUEST_BODY = 4 * 1024 * 1024
# Requests parsed and tokenized at once: each may hold a 4 MiB body's worth of
# Python objects; more wait (they are bounded by the connection limit).
PREPARE_THREADS = 2
# A streamed answer is admitted before its 200 head is written and its
# producer runs after: if the driver never starts the producer (the head
# could not be written, the client being gone), the ticket is reclaimed this
# long after admission (the client may also leave in the instant between the
# two). Writing a head of a few hundred bytes takes far less; a producer that
# does start later still ends well, only without holding a ticket.
STREAM_START_GRACE = 2.0

Spawn = Callable[..., None]  # start_soon of a task group that outlives requests


class OpenAIService:
    """Answers the /v1 endpoints for one served model through one chain."""

    def __init__(
        self,
        model: ServedModel,
        pool: Downstream,
        codecs: CodecPool,
        chain_settings: Callable[[], ChainSettings],
        *,
        max_tokens_default: int = 256,
        max_prompt_tokens: int | None = None,
        max_prompt_chars: int = 0,
        max_messages: int = MAX_MESSAGES,
        special_tokens_in_content: str = "escape",
        metrics: GenerationMetrics | None = None,
        admission: Admission | None = None,
        spawn: Spawn | None = None,
        serving: ServingMetrics | None = None,
    ) -> None:
        self.model = model
        self.prompt_limits = PromptLimits.for_context(
            model.context_length, max_prompt_chars, max_messages
        )
        self.chat_encoder = ChatEncoder(model.tokenizer, special_tokens_in_content)
        self.tool_prompt = ToolPrompt(self.chat_encoder)
        self.grammars = GrammarCompiler(model.tokenizer, model.vocab_size)
        self._preparing: anyio.CapacityLimiter | None = None  # made on the loop
        self.pool = pool
        self.codecs = codecs
        self.chain_settings = chain_settings  # read per request: the inflight cap may change
        self.max_tokens_default = max_tokens_default
        self.max_prompt_tokens = max_prompt_tokens
        self.active: set[str] = set()  # chain sessions of requests in progress
        # Shutdown: each open stream's generation scope, and when they must end
        # (None until the server drains): see end_streams_by.
        self.streams = OpenStreams()
        self.metrics = metrics
        # None: every request starts at once (tests of the surface alone).
        self.admission = admission
        self.spawn = spawn
        if metrics is not None:
            metrics.active.set_function(lambda: len(self.active))
            if admission is not None:
                metrics.admitted.set_function(lambda: admission.running)
                metrics.queued.set_function(lambda: admission.queued)
                metrics.prefill_tokens_admitted.set_function(lambda: admission.prefill_tokens)
                admission.on_refused = lambda reason: metrics.refused.labels(reason).inc()
                admission.on_waited = metrics.queue_wait_seconds.observe
        # vLLM's names (docs/gateway.md, "Serving metrics"): running is what
        # admission let in (without admission: what is in progress).
        self.serving = serving
        if serving is not None:
            if admission is not None:
                serving.running.set_function(lambda: admission.running)
                serving.waiting.set_function(lambda: admission.queued)
            else:
                serving.running.set_function(lambda: len(self.active))

    async def handle(
        self,
        event: EndpointRequest,
        timing: RequestTiming | None = None,
        *,
        tenancy: Tenancy | None = None,
    ) -> Reply | StreamReply:
        """``timing``: the request's record, filled in as the generation goes
        (the gateway's access log reads it); one is made here when not given.
        ``tenancy``: whom it serves (the chain is told, wire-2 §3.15)."""
        if timing is None:
            timing = RequestTiming(arrived=anyio.current_time())
        try:
            if event.route == UNKNOWN_ROUTE:
                raise unknown_path(event.method, event.path)
            if event.path == "/v1/models":
                return Reply.json(200, {"object": "list", "data": [self._model_card()]})
            if event.path.startswith("/v1/models/"):
                self._check_model(event.path.removeprefix("/v1/models/"), param=None)
                return Reply.json(200, self._model_card())
            if self._preparing is None:
                self._preparing = anyio.CapacityLimiter(PREPARE_THREADS)
            ids, options, fmt, grammar = await anyio.to_thread.run_sync(
                self._prepare, event.path, event.body, limiter=self._preparing
            )
            return await self._serve(ids, options, fmt, timing, tenancy, grammar)
        except OpenAIError as exc:
            # One line, no traceback, no client text: a refused request must
            # not become a log flood.
            log.info(
                "%s %s: %d %s (param %s)", event.method, event.path, exc.status, exc.code, exc.param
            )
            return exc.reply()

    def _prepare(
        self, path: str, body: bytes
    ) -> tuple[list[int], GenerationOptions, _Format, Grammar | None]:
        """Body → checked request → prompt ids and the grammar the answer
        must follow; in a worker thread (user-sized work)."""
        document = parse_json_object(body)
        if path == "/v1/completions":
            completion = parse_completion(document)
            options = completion.options
            self._check_model(options.model)
            ids = self._completion_ids(completion)
            fmt: _Format = _CompletionFormat(self.model.name)
        else:
            chat = parse_chat(document, self.prompt_limits)
            options = chat.options
            self._check_model(options.model)
            ids = self._chat_ids(chat)
            tools = options.tools
            if tools is not None and tools.offered:
                names = tuple(t.name for t in tools.tools)
                fmt = _ChatFormat(self.model.name, self.tool_prompt.syntax, names)
            else:
                fmt = _ChatFormat(self.model.name)
        self._budget(ids, options)  # refused here, before any chain work
        options.check_vocab(self.model.tokenizer.vocab_size)
        return ids, options, fmt, request_grammar(self.grammars, self.tool_prompt.syntax, options)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "meshnet",
            "context_length": self.model.context_length,
        }

    def _check_model(self, name: str, param: str | None = "model") -> None:
        if name != self.model.name:
            raise OpenAIError(
                f"The model {shown(name)} does not exist (this gateway serves '{self.model.name}')",
                status=404,
                param=param,
                code="model_not_found",
            )

    # ------------------------------------------------------------ requests

    def _completion_ids(self, request: CompletionRequest) -> list[int]:
        tokenizer = self.model.tokenizer
        if isinstance(request.prompt, str):
            # Capped before encoding: the encode is what costs.
            self.prompt_limits.check_chars("prompt", [request.prompt])
            return tokenizer.encode(checked_text("prompt", request.prompt))
        ids = request.prompt
        if len(ids) >= self.model.context_length:
            return ids  # _budget refuses it by its length, without a scan
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise invalid("prompt", f"token ids must be in [0, {vocab})", "invalid_value")
        return ids

    def _chat_ids(self, request: ChatRequest) -> list[int]:
        messages = request.messages
        self.prompt_limits.check_chars(
            "messages", (text for m in messages for text in (m["role"], m["content"]))
        )
        for index, message in enumerate(messages):
            checked_text(f"messages.[{index}].role", message["role"])
            checked_text(f"messages.[{index}].content", message["content"])
        check_names(self.model.tokenizer, messages)
        try:
            return self.tool_prompt.encode(messages, request.options.tools)
        except ChatTemplateError as exc:
            raise invalid("messages", str(exc), "invalid_messages") from None

    def _budget(self, ids: list[int], options: GenerationOptions) -> int:
        """``max_tokens`` for this request, after checking the prompt fits."""
        if not ids:
            raise invalid("prompt", "the prompt has no tokens", "empty_prompt")
        context = self.model.context_length
        limit = context if self.max_prompt_tokens is None else min(context, self.max_prompt_tokens)
        if len(ids) >= limit:
            raise invalid(
                "prompt",
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{len(ids)} tokens (at most {limit - 1} leave room to generate).",
                "context_length_exceeded",
            )
        room = context - len(ids)
        if options.max_tokens is None:
            default = self.model.defaults.max_new_tokens or self.max_tokens_default
            return min(default, room)
        if options.max_tokens > room:
            raise invalid(
                "max_tokens",
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {shown(len(ids) + options.max_tokens)} tokens ({len(ids)} in the "
                f"prompt, {shown(options.max_tokens)} for the completion).",
                "context_length_exceeded",
            )
        return options.max_tokens

    async def _serve(
        self,
        ids: list[int],
        options: GenerationOptions,
        fmt: _Format,
        timing: RequestTiming,
        tenancy: Tenancy | None = None,
        grammar: Grammar | None = None,
    ) -> Reply | StreamReply:
        max_tokens = self._budget(ids, options)  # checked in _prepare: cheap now
        sampling = self.model.defaults.sampling(options.sampling, options.explicit)
        if tenancy is not None:
            tenancy = tenancy.salted(options.cache_salt)
        settings = self.chain_settings()
        timing.prompt_tokens = len(ids)
        timing.queued = anyio.current_time()
        # Last before the work: nothing between here and run()'s (or
        # produce()'s) ``finally`` can fail or be cancelled without the
        # ticket going back. One ticket for all n choices: one request.
        ticket = await admit(self.admission, len(ids), None if tenancy is None else tenancy.name)
        timing.admitted = anyio.current_time()
        gate = None if ticket is None else admission_gate(ticket)
        if self.serving is not None:
            self.serving.queue_time.observe(timing.admitted - timing.queued)

        async def run(on_text: Callable[[int], OnText] | None) -> list[GenerationResult]:
            async def one(index: int, prefilled: Callable[[], None] | None) -> GenerationResult:
                chain = ChainSession(
                    self.pool, self.codecs, settings, metrics=self.metrics, tenancy=tenancy
                )
                chain.gate = gate
                constraint = None if grammar is None else grammar.constraint()
                sampler = Sampler(sampling, choice_seed(options.seed, index), constraint)
                text = None if on_text is None else on_text(index)
                # A single choice gives its ticket back before its DELETE.
                held = ticket if options.n == 1 else None
                args = (ids, held, fmt, max_tokens, sampler, options, text, timing)
                return await self._run(chain, *args, prefilled)

            try:
                return await run_choices(options.n, one)
            finally:
                if ticket is not None:
                    ticket.release()

        if not options.stream:
            try:
                results = await run(None)
            except MeshnetError as exc:
                raise from_meshnet(exc) from None
            return Reply.json(200, fmt.whole(results))

        started = anyio.Event()

        async def produce(send: StreamSend) -> None:
            started.set()
            try:
                args = (options.n, options.include_usage, run, self.streams)
                await stream_events(send, fmt, *args)
            finally:
                if ticket is not None:
                    ticket.release()  # run() did, unless it never started

        if ticket is not None and self.spawn is not None:
            self.spawn(_reclaim_unstarted, ticket, started)
        return StreamReply(200, SSE_HEADERS, produce, heartbeat=SSE_HEARTBEAT)

    def end_streams_by(self, deadline: float) -> int:
        """Shutdown: every open stream (and any started from now on) ends by
        ``deadline`` (anyio's clock) with an error event and ``data: [DONE]``,
        rather than running on until the drain cuts it mid-answer; how many
        are open."""
        return self.streams.end_by(deadline)

    async def _run(
        self,
        chain: ChainSession,
        ids: list[int],
        ticket: Ticket | None,
        fmt: _Format,
        max_tokens: int,
        sampler: Sampler,
        options: GenerationOptions,
        on_text: OnText | None,
        timing: RequestTiming,
        prefilled: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """One generation on ``chain``; every exit (done, failed, or cancelled
        by a client that left) gives the ticket back, closes the chain session
        and counts the outcome. ``prefilled``: called once the prompt is in."""
        session = chain.session  # the chain may start over in another (a refused prefix)
        self.active.add(session)
        outcome = "cancelled"  # unless it ends any other way: the client left
        serving = self.serving
        counted = None if serving is None else partial(serving.prompt_tokens.inc, len(ids))

        def on_prefilled() -> None:
            for call in (counted, prefilled):
                if call is not None:
                    call()

        def on_token() -> None:
            gap = timing.token(anyio.current_time())
            if serving is None:
                return
            serving.generation_tokens.inc()
            if gap is None:  # the first token: its latency, and the prefill's
                now = timing.last_token or timing.arrived
                serving.ttft.observe(now - timing.arrived)
                serving.prefill_time.observe(now - (timing.admitted or timing.arrived))
            else:
                serving.tpot.observe(gap)
                serving.itl.observe(gap)

        try:
            result = await generate(
                chain,
                self.model.tokenizer,
                ids,
                max_tokens=max_tokens,
                sampler=sampler,
                stop=options.stop,
                on_text=on_text,
                on_prefilled=on_prefilled,
                on_token=on_token,
                sample_at=chain.settings.sample_at,
                speculate=chain.settings.speculate,
            )
            outcome = timing.finish_reason = result.finish_reason
            if self.metrics is not None:
                self.metrics.completion_tokens.inc(result.completion_tokens)
            if serving is not None:
                serving.finished(timing, result, anyio.current_time())
            return result
        except Exception:
            outcome = "error"
            raise
        finally:
            if ticket is not None:
                ticket.release()  # before the DELETE: the chain work is over
            await chain.close()
            timing.drafted, timing.accepted = chain.drafted, chain.accepted
            if (speculate := chain.settings.speculate) is not None:
                timing.drafter = speculate.drafter
            self.active.discard(session)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(ids))
                self.metrics.generations.labels(fmt.endpoint, outcome).inc()


async def _reclaim_unstarted(ticket: Ticket, started: anyio.Event) -> None:
    """A stream's ticket back if its producer never started (see STREAM_START_GRACE)."""
    with anyio.move_on_after(STREAM_START_GRACE):
        await started.wait()
        return
    if not ticket.released:
        log.warning("a streamed answer never started; its admission ticket is reclaimed")
        ticket.release()

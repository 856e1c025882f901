"""Speculative decoding, the gateway's side (issue 38, wire-2 §3.16).

A plain decode step sends one token down the chain and gets one back. A
**verify window** sends ``[t, d1 … dk]`` — the last accepted token and ``k``
tokens drafted by prompt lookup (``drafts.PromptLookup``, no model) or by a
draft model (``--draft-model``, ``draft_model.DraftModel``) — as one
sampled chunk with ``X-Meshnet-Draft``; the last stage draws every row as a
plain step would (the same ``(seed, position)`` draws) and answers the drafts
it accepted, then its own next token: 1 to ``k + 1`` tokens for one trip,
token for token what plain decoding gives, at any temperature.

**Windows in flight.** Up to ``windows`` windows of a generation are in the
chain at once: window i+1 is drafted assuming window i is wholly accepted and
its bonus token is the drafted continuation (one lookup of ``1 + k'`` tokens
past window i's drafts: the guessed bonus, then window i+1's drafts). Every
window carries ``X-Meshnet-After`` (the position the windows before it leave,
and the session's epoch), so the nodes run them in order however they arrive.
Answers are taken in order; when one shows a rejection (or a bonus other
than the guess), the windows after it are **stale**: their answers are
discarded, and the next chunk — a window or a plain step — is a **rewind**:
its position is the accepted one, its ``After`` the position every window
sent leaves, with the next epoch, so it runs after the stale ones at every
node and takes them back. ``session_lines.Lines`` keeps that count.

A stale window's answer is not waited for. Its failure is not dropped,
though: unless it is 409 ``window_stale`` (a retransmission that came after
the rewind had run: nothing is lost), a stale window that failed may not
have run at every stage, and the rewind behind it would wait there until
the node's reorder timeout; so the failure fails the generation at once, at
its next step, with its real cause. When the generation ends, the windows
still in the chain are cancelled (the DELETE that follows frees what they
computed).

**When not.** ``DraftPolicy`` sizes each window from the measured acceptance
(0: a plain step, exactly as without speculation), and so does the lookup
(nothing to propose: a plain step). A sampler that needs more than the
logits (``Sampler.stateless``: penalties, ``logit_bias``, a ``min_tokens``
mask in force) takes plain steps drawn at the gateway; so does a generation
whose prefill was answered with logits (a chain that draws nothing,
§3.13). A window answered with logits (a last stage without §3.16, which
computed the window as a plain chunk) ends speculation for the generation:
its session is deleted and the prompt and the accepted tokens go down again
in a new one, and the generation goes on plainly from there.

The session's history and block keys (the prefix cache, §3.10) follow the
accepted tokens only; windows carry no ``X-Meshnet-Prefix-Blocks``, so the
blocks that end inside a window are never filed, and the prefix index is
never told the chain holds them (``session_lines.Lines.filed``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

import anyio
import numpy as np

from meshnet_proto import MeshnetError, WireHeaders
from meshnet_proto.lowlevel import SampleSpec
from meshnet_runtime.deadlines import Deadline

from .._pipeline import check_response
from .._retry import send_with_retries
from .draft_model import Drafter, DraftModel, LookupDrafter
from .drafts import DraftPolicy, PromptLookup
from .drawn import Answer, Drawn, spec_for_last_stage
from .output import Output, Tokens
from .window_answer import read_window

if TYPE_CHECKING:
    from .generation import ChainSession

__all__ = ["ChainSupport", "Speculate", "decode"]

log = logging.getLogger("meshnet.gateway.openai")

T = TypeVar("T")
Args = TypeVarTuple("Args")


# After a chain could not verify a window, this many generations go plainly
# before one tries again (a node may have been upgraded meanwhile): one
# session started over in 65 generations, not one in every generation.
PLAIN_AFTER_REFUSAL = 64


class ChainSupport:
    """Whether the chain verifies windows, as a gateway's generations last
    found (shared by them all)."""

    def __init__(self) -> None:
        self.plain_for = 0  # generations still to go plainly

    def usable(self) -> bool:
        """Whether this generation may send windows (counts it if not)."""
        if self.plain_for > 0:
            self.plain_for -= 1
            return False
        return True

    def refused(self) -> None:
        self.plain_for = PLAIN_AFTER_REFUSAL


@dataclass(frozen=True, slots=True)
class Speculate:
    """``--speculate lookup``'s settings: the most tokens drafted in one
    window (``--speculate-max-draft``) and windows in flight
    (``--speculate-windows``); what the chain was found to support; the
    draft model (``--draft-model``; None: prompt lookup drafts)."""

    max_draft: int = 8
    windows: int = 2
    support: ChainSupport = field(default_factory=ChainSupport, compare=False)
    model: DraftModel | None = field(default=None, compare=False)

    @property
    def drafter(self) -> str:
        """Which drafter (the access line's ``drafter=``)."""
        return "lookup" if self.model is None else "model"

    def new_drafter(self, max_tokens: int, stop_ids: frozenset[int]) -> Drafter:
        """A generation's drafter; ``max_tokens``: the most it will hold."""
        if self.model is not None:
            return self.model.drafter(stop_ids)
        # A successor window asks for its guessed bonus as well as its drafts.
        return LookupDrafter(PromptLookup(max_draft=self.max_draft + 1, max_tokens=max_tokens))

    def describe(self) -> dict[str, Any]:
        """For the gateway's ``/info``."""
        model = None if self.model is None else self.model.describe()
        return {
            "drafter": self.drafter,
            "max_draft": self.max_draft,
            "windows": self.windows,
            "draft_model": model,
        }

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft <= 64:
            raise ValueError(f"max_draft must be in 1..64, got {self.max_draft}")
        if not 1 <= self.windows <= 8:
            raise ValueError(f"windows must be in 1..8, got {self.windows}")


async def decode(
    chain: ChainSession,
    output: Output,
    tokens: Tokens,
    answer: Answer,
    prompt_ids: Sequence[int],
    remote: bool,
    speculate: Speculate | None,
) -> None:
    """The decode loop after the prefill's ``answer``, until ``tokens`` ends.

    ``remote``: the last stage draws while the sampler lets it (wire-2
    §3.13); with ``speculate`` it verifies windows too (the caller passes
    None for a chain that draws nothing)."""
    token, entry = await output.choose(answer, chain)
    if await tokens.take(token, entry):
        return
    if speculate is not None and speculate.support.usable():
        rest = await _speculate(chain, output, tokens, speculate, prompt_ids, token)
        if rest is None:
            return
        token, entry = await output.choose(rest, chain)
        if await tokens.take(token, entry):
            return
    while True:
        sample = await spec_for_last_stage(output.sampler) if remote else None
        answer = await chain.step(token, sample)
        token, entry = await output.choose(answer, chain)
        if await tokens.take(token, entry):
            return


async def _speculate(
    chain: ChainSession,
    output: Output,
    tokens: Tokens,
    settings: Speculate,
    prompt_ids: Sequence[int],
    token: int,
) -> Answer | None:
    """``Speculator.run`` with its windows as tasks of a group of their own,
    cancelled when it returns; a failure is raised as itself."""
    failure: Exception | None = None
    rest: Answer | None = None
    async with anyio.create_task_group() as group:
        speculator = Speculator(chain, output, tokens, settings, prompt_ids, group)
        try:
            rest = await speculator.run(token)
        except Exception as exc:  # raised below, not inside the group's ExceptionGroup
            failure = exc
        finally:
            speculator.close()
    if failure is not None:
        raise failure
    return rest


class _Window:
    """One verify window sent: ``[last, *drafts]``."""

    def __init__(self, last: int, drafts: list[int], sample: SampleSpec) -> None:
        self.last = last
        self.drafts = drafts
        self.sample = sample
        self.stale = False
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        self.tensor: np.ndarray | None = None
        self.accepted: int | None = None  # the answer's X-Meshnet-Accepted (wire-2 §3.16)
        self.error: MeshnetError | None = None


class Speculator:
    """One generation's verify windows: drafting, sending, deciding."""

    def __init__(
        self,
        chain: ChainSession,
        output: Output,
        tokens: Tokens,
        settings: Speculate,
        prompt_ids: Sequence[int],
        group: anyio.abc.TaskGroup,
    ) -> None:
        self.chain = chain
        self.output = output
        self.tokens = tokens
        self.settings = settings
        self.prompt_ids = prompt_ids
        self.group = group
        # Built when the first window may go (``_drafter``): a sampler that
        # never lets the last stage draw never pays for indexing the prompt.
        self.lookup: Drafter | None = None
        self.known = 0  # the lookup's accepted tokens; past them: in flight
        self.pending: list[int] = []  # the lookup's tokens past ``known``
        self.policy = DraftPolicy(max_draft=settings.max_draft)
        self.flight: deque[_Window] = deque()
        self.stale: list[_Window] = []
        self.failure: MeshnetError | None = None  # a stale window's, raised at the next step
        self.waiting: anyio.CancelScope | None = None
        metrics = chain.metrics
        self.metrics = None if metrics is None else metrics.speculation

    async def run(self, token: int) -> Answer | None:
        """Decode from ``token`` (accepted and taken) until the generation
        ends (None), or the chain cannot verify a window: then the answer to
        go on from plainly, in a new session."""
        while True:
            self._raise_failure()
            sample = await spec_for_last_stage(self.output.sampler)
            if sample is not None and sample.allow is None:  # a mask is for one draw
                await self._fill(await self._drafter(), token, sample)
            if not self.flight:
                token, ended = await self._plain_step(token, sample)
            else:
                head = self.flight.popleft()
                tensor = await self._landed(head)
                url = self.chain.pool.url
                drawn = (
                    None
                    if tensor is None
                    else read_window(tensor, head.sample, head.drafts, url, head.accepted)
                )
                if drawn is None:
                    return await self._fall_back(head.sample)
                token, ended = await self._decided(head, drawn)
            if ended:
                return None

    async def _drafter(self) -> Drafter:
        """The drafter fed the prompt and every token so far, built once in
        a worker thread (a long prompt is tens of milliseconds of indexing)."""
        if self.lookup is None:
            ids = [*self.prompt_ids, *self.output.result.token_ids]
            # Room for every token the generation may take.
            size = len(self.prompt_ids) + self.tokens.max_tokens + 1
            lookup = self.settings.new_drafter(size, self.output.sampler.stop_ids)
            await anyio.to_thread.run_sync(lookup.extend, ids)
            self.lookup, self.known = lookup, len(ids)
        return self.lookup

    def _accept_into_lookup(self, ids: list[int]) -> None:
        if self.lookup is not None:  # else it is built from the result's tokens
            self.lookup.extend(ids)
            self.known += len(ids)

    async def _plain_step(self, token: int, sample: SampleSpec | None) -> tuple[int, bool]:
        """A step without drafts, exactly as without speculation."""
        if sample is not None:
            self.policy.observe(0, 0)
        answer = await self._unless_stale_failed(self.chain.step, token, sample)
        token, entry = await self.output.choose(answer, self.chain)
        self._accept_into_lookup([token])
        return token, await self.tokens.take(token, entry)

    async def _fill(self, lookup: Drafter, token: int, sample: SampleSpec) -> None:
        """Send windows until as many are in flight as the policy's depth
        allows, while there is something to draft and room for them."""
        chain = self.chain
        while len(self.flight) < self.policy.depth(self.settings.windows):
            # A window of k drafts yields at most k + 1 tokens.
            room = self.tokens.remaining - sum(len(w.drafts) + 1 for w in self.flight)
            k = min(self.policy.k, room - 1)
            if k < 1:
                return
            if not self.flight:
                drafts = await lookup.propose(k)
                if not drafts:
                    return
                last, start, proposed = token, chain.position, drafts
            else:
                proposed = await lookup.propose(k + 1)
                if len(proposed) < 2:
                    return
                # The window before is assumed accepted whole, ``last`` its bonus.
                last, drafts = proposed[0], proposed[1:]
                start = chain.lines.held(chain.position)
            lookup.extend(proposed)
            self.pending += proposed
            self._send(start, last, drafts, sample)

    def _send(self, start: int, last: int, drafts: list[int], sample: SampleSpec) -> None:
        chain = self.chain
        size = len(drafts) + 1
        headers = WireHeaders(
            shape=(1, size),
            dtype="int32",
            session=chain.session,
            chunk_index=0,
            chunk_total=1,
            position=start,
            stage=chain.settings.stage,
            session_key=chain.key,
            sample=sample,
            draft=tuple(drafts),
            after=chain.lines.window(chain.position, start, size),
        )
        body = np.asarray([[last, *drafts]], dtype=np.int32).tobytes()
        chain.chunks += 1  # counted before it goes: the session is then deleted
        chain.runs += 1
        window = _Window(last, drafts, sample)
        self.flight.append(window)
        self.group.start_soon(self._fly, window, headers, body)

    async def _fly(self, window: _Window, headers: WireHeaders, body: bytes) -> None:
        """One window down the chain (retried as any chunk) and its answer."""
        chain = self.chain
        settings = chain.settings
        with window.scope:
            try:
                deadline = Deadline.after(settings.timeout)
                response = await send_with_retries(
                    chain.pool, headers, body, deadline, settings.retry
                )
                check_response(chain.pool, headers, response.headers)
                window.tensor = await chain.codecs.decode(response.headers, response.body)
                window.accepted = response.headers.accepted
            except MeshnetError as exc:
                chain.suspect(exc)
                window.error = exc
                if window.stale:
                    self._stale_failed(window)
            finally:
                window.done.set()

    async def _unless_stale_failed(self, call: Callable[[*Args], Awaitable[T]], *args: *Args) -> T:
        """``await call(*args)``, ended by a stale window's failure (raised)."""
        self._raise_failure()
        try:
            with anyio.CancelScope() as self.waiting:
                return await call(*args)
        finally:
            self.waiting = None
        self._raise_failure()  # only a stale window's failure cancels the scope
        raise AssertionError("unreachable")

    async def _landed(self, window: _Window) -> np.ndarray | None:
        """The window's answer, once it is in (None: a chain that cannot
        verify windows refused it); a stale window's failure while waiting
        ends the wait (and the generation)."""
        await self._unless_stale_failed(window.done.wait)
        if window.error is not None:
            if (window.error.status, window.error.code) == (400, "bad_draft"):
                # A last stage whose stage makes one row of logits, not k + 1
                # (a stub, another engine): the window itself was well formed.
                return None
            raise window.error
        assert window.tensor is not None
        return window.tensor

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _stale_failed(self, window: _Window) -> None:
        error = window.error
        if error is None or error.code == "window_stale" or self.failure is not None:
            return  # window_stale: a retransmission after the rewind ran, nothing lost
        self.failure = error
        if self.waiting is not None:
            self.waiting.cancel()

    async def _decided(self, head: _Window, drawn: list[Drawn]) -> tuple[int, bool]:
        """A window's answer: the session keeps ``head.last`` and the accepted
        drafts; each token then goes out as a plain step's would."""
        ids = [d.token for d in drawn]
        n, k = len(ids), len(head.drafts)
        self.chain.keep([head.last, *ids[:-1]])
        matched = _common(ids, self.pending)
        if n == k + 1 and matched == n:
            self.pending = self.pending[n:]  # the next window, if any, follows on
        else:
            assert self.lookup is not None  # a window went: it was built
            self.lookup.rewind(self.known + matched)
            self.lookup.extend(ids[matched:])
            self.pending = []
            self._stale_all()
        self.known += n
        accepted = _common(ids, head.drafts)
        self.policy.observe(k, accepted)
        self.chain.drafted += k
        self.chain.accepted += accepted
        if self.metrics is not None:
            self.metrics.window(k, accepted)
        for one in drawn:
            token, entry = await self.output.choose(one, self.chain)
            if await self.tokens.take(token, entry):
                return token, True
        return ids[-1], False

    def _stale_all(self) -> None:
        """Every window in flight follows a rejection: discard their answers."""
        if not self.flight:
            return
        if self.metrics is not None:
            self.metrics.stale.inc(len(self.flight))
        self.stale = [w for w in self.stale if not w.done.is_set()]
        for window in self.flight:
            window.stale = True
            if window.done.is_set():
                self._stale_failed(window)
            else:
                self.stale.append(window)
        self.flight.clear()

    async def _fall_back(self, sample: SampleSpec) -> Answer:
        """A window answered with logits (a last stage without wire-2 §3.16
        took it as a plain chunk) or refused 400 ``bad_draft`` (a stage that
        makes one row of logits): the session holds drafts nobody accepted,
        and may not know rewinds. A new one takes the prompt and the
        accepted tokens, the generation goes on plainly from its answer, and
        the next ``PLAIN_AFTER_REFUSAL`` generations do not try windows."""
        log.warning(
            "session %s: the chain cannot verify windows (wire-2 §3.16): this generation "
            "goes on without speculation, and the next %d do too",
            self.chain.session,
            PLAIN_AFTER_REFUSAL,
        )
        self.settings.support.refused()
        if self.metrics is not None:
            self.metrics.fallbacks.inc()
        self.cancel_all()
        await self.chain.restart()
        ids = [*self.prompt_ids, *self.output.result.token_ids]
        return await self.chain.prefill(ids, sample)

    def close(self) -> None:
        """The generation's speculation is over: its windows and its drafter."""
        self.cancel_all()
        if self.lookup is not None:
            self.lookup.close()

    def cancel_all(self) -> None:
        """Windows still in the chain: their answers are not needed any more."""
        for window in (*self.flight, *self.stale):
            window.scope.cancel()
        self.flight.clear()
        self.stale.clear()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

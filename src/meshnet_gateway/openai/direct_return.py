"""The direct return, the gateway's side (wire-2 §3.14).

A decode step's relayed answer crosses every hop back (2 x S one-way delays
for S stages). With ``--direct-return URL`` (the last stage, as the gateway
reaches it) each sampled decode step is sent down the chain as always, and
at the same moment the gateway asks the last stage for the token that step
will draw (``GET /drawn/{session}?position=P``, with the session's key): the
token arrives after S + 1 delays, and the next step leaves at once.

Polling pays only where the relayed answer comes back later than the
polled one by a link's delay: each relay's lag behind its poll is measured,
and while it stays under ``WORTH_S`` (loopback) the steps go without a poll
but for probes: every generation's first step, and one in ``PROBE_EVERY``.

The relayed answer stays the authority. It is awaited in the background (a
``Pipeline`` a generation holds open), checked as before, and held to the
token taken early: a relay that fails, or names another token, fails the
generation (502) at its next step or at its end. A poll that gets no token
— another replica holds the session, a timeout, any error — costs nothing
but its wait: the step takes the relayed answer instead.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import numpy as np

from meshnet_proto import ActivationResponse, MeshnetError, WireHeaders
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool, key_headers

from .._pipeline import check_response

__all__ = ["PROBE_EVERY", "WORTH_S", "DirectReturn", "Pipeline", "Relay", "pipelined"]


# A poll costs each end a request; it pays when the relayed answer lands at
# least this much later than the polled one (a link's delay: 5 ms on wifi,
# ~0.1 ms on loopback, where polling only adds work on shared cores).
WORTH_S = 0.002
# While polling does not pay, every this many steps one is polled anyway, to
# see whether the link changed.
PROBE_EVERY = 32


class DirectReturn:
    """Polls one chain's last stage for the tokens it draws, while that pays;
    counts the outcomes."""

    def __init__(self, pool: DownstreamPool, codecs: CodecPool, worth_s: float = WORTH_S) -> None:
        self.pool = pool
        self.codecs = codecs
        self.worth_s = worth_s  # 0: poll every step whatever the lag
        self.taken = 0  # steps answered by a poll
        self.missed = 0  # polls that got no token: the relayed answer served
        self.skipped = 0  # steps not polled: the relayed answer came as soon
        # How much later the relayed answer landed than the polled one, the
        # last time both came (seconds); None until measured.
        self.lag: float | None = None
        self._since_probe = 0

    def worth_polling(self, probe: bool = False) -> bool:
        """Whether to poll for the next step: ``lag`` >= ``worth_s``, or a
        probe (``probe``: a generation's first step; or one in ``PROBE_EVERY``)."""
        if probe or self.lag is None or self.lag >= self.worth_s:
            return True
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            return True
        self.skipped += 1
        return False

    def describe(self) -> dict[str, Any]:
        """For the gateway's ``/info``: where it polls and how that went."""
        lag = None if self.lag is None else round(self.lag * 1000, 3)
        return {
            "url": self.url,
            "taken": self.taken,
            "missed": self.missed,
            "skipped": self.skipped,
            "lag_ms": lag,
        }

    def observe_lag(self, seconds: float) -> None:
        """The last relay's lag decides: a link's delay is far above the
        threshold and loopback's far below, so one measurement says which
        (an average would let a probe on a changed link count for little)."""
        self.lag = max(0.0, seconds)

    @property
    def url(self) -> str:
        return self.pool.url

    async def poll(
        self, headers: WireHeaders, key: str | None, deadline: Deadline
    ) -> np.ndarray | None:
        """The answer to the step sent with ``headers``, as the last stage
        drew it, or None when it could not be had this way."""
        target = f"/drawn/{headers.session}?position={headers.position}"
        try:
            response = await self.pool.fetch_activation(target, deadline, key_headers(key))
            if not isinstance(response, ActivationResponse):
                raise response.to_error(hop=self.url)
            check_response(self.pool, headers, response.headers)
            tensor = await self.codecs.decode(response.headers, response.body)
        except MeshnetError:
            self.missed += 1
            return None
        self.taken += 1
        return tensor

    async def aclose(self) -> None:
        await self.pool.aclose()


class Relay:
    """One decode step's relayed answer, still on its way back."""

    def __init__(
        self,
        check: Callable[[np.ndarray, np.ndarray], None],
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.done = anyio.Event()
        self.answer: np.ndarray | None = None
        self.error: MeshnetError | None = None
        self._check = check  # (relayed, taken early): raises MeshnetError if they differ
        self._on_lag = on_lag  # how much later than the early answer the relayed one landed
        self._taken: np.ndarray | None = None
        self._taken_at = self._landed_at = 0.0

    async def result(self) -> np.ndarray:
        """The relayed answer (the step's only one, when no poll got a token)."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer

    def took(self, early: np.ndarray) -> None:
        """The step went on with ``early``: the relayed answer must agree."""
        self._taken, self._taken_at = early, time.perf_counter()
        if self.answer is not None:
            self._lagged()
            self._check(self.answer, early)  # it came first: held to it now

    def landed(self, answer: np.ndarray) -> None:
        self.answer, self._landed_at = answer, time.perf_counter()
        if self._taken is not None:
            self._lagged()
            self._check(answer, self._taken)

    def _lagged(self) -> None:
        if self._on_lag is not None:
            self._on_lag(self._landed_at - self._taken_at)


class Pipeline:
    """A generation's relays in flight: each runs as a task of the
    generation's own group; the first failure is raised at the next step or
    when the generation ends."""

    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self.group = group
        self.failure: MeshnetError | None = None

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def start(
        self,
        send: Callable[[], Awaitable[np.ndarray]],
        check: Callable[[np.ndarray, np.ndarray], None],
        on_lag: Callable[[float], None] | None = None,
    ) -> Relay:
        relay = Relay(check, on_lag)

        async def run() -> None:
            try:
                relay.landed(await send())
            except MeshnetError as exc:
                relay.error = exc
                if self.failure is None:
                    self.failure = exc
            finally:
                relay.done.set()

        self.group.start_soon(run)
        return relay


@asynccontextmanager
async def pipelined() -> AsyncIterator[Pipeline]:
    """A pipeline whose relays all land (or are cancelled) before it closes;
    the first relay failure is raised then."""
    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        pipeline = Pipeline(group)
        try:
            yield pipeline
        except Exception as exc:  # raised as itself below, not inside the group's group
            failure = exc
            group.cancel_scope.cancel()  # nobody waits for the relays any more
    if failure is not None:
        raise failure
    pipeline.raise_failure()

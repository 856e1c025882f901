"""The gateway's chain check (wire-2 §6.2): walk the chain by deep health,
check it, and refuse to send anything down while it lists problems.

Checked at start (``fail_fast``: problems end the process, see
``meshnet-gateway``), every health interval, and at once after a sign
that the chain changed (a replica set below changed, a node answered
``stage_mismatch`` or ``session_unknown``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from meshnet_proto import CapacityError, ErrorCode, MeshnetError
from meshnet_proto.lowlevel import ChainProblem
from meshnet_runtime.control import ControlEndpoints, not_ready

from .config import GatewayConfig
from .entry import STARTUP_INFO_ATTEMPTS, STARTUP_INFO_RETRY_S

__all__ = ["RECHECK_CODES", "ChainCheck", "ChainMismatch", "gateway_facts"]

log = logging.getLogger("meshnet.gateway")

# Answers below that may mean the chain changed under us (wire-2 §6.2):
# the check runs again at once rather than at the next interval.
RECHECK_CODES = frozenset({"stage_mismatch", "session_unknown"})


class ChainMismatch(Exception):
    """The chain failed its check at start (wire-2 §6.2): the process exits 2."""

    def __init__(self, problems: list[ChainProblem]) -> None:
        super().__init__(problems[0].line())
        self.problems = problems


class ChainCheck:
    """The check's state and its tasks, over the gateway's control endpoints
    (whose ``walk`` asks the chain and finds the problems).

    ``problems``: what the last walk that got an answer found ([] = fine,
    None = not walked yet). ``expected_entry``: the stage the entry must be
    (``"<model>/0"``, X-Meshnet-Stage), from the entry's identity once a
    walk has seen it (a model stage only).
    """

    def __init__(self, control: ControlEndpoints, url: str, health_interval: float) -> None:
        self.control = control
        self.url = url
        self.health_interval = health_interval
        self.problems: list[ChainProblem] | None = None
        # The code of the last walk's failure when it got no answer (the
        # chain below the entry down, say): None once one answers again.
        self.unanswered: str | None = None
        self.fail_fast = False
        self.expected_entry: str | None = None
        self._recheck: anyio.Event | None = None

    def arm(self) -> None:
        """From now on a change asks for a check (``changed``)."""
        self._recheck = anyio.Event()

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """The first check, then the periodic one in ``tg``; with ``fail_fast``,
        problems found at start raise ``ChainMismatch``."""
        if await self.check(quiet=True) is None:
            tg.start_soon(self._check_at_start)  # the entry is not up yet
        else:
            self._fail_fast()
        tg.start_soon(self._recheck_loop)

    async def check(self, *, quiet: bool = False) -> list[ChainProblem] | None:
        """Walk the chain by deep health and check it; the problems, or None
        when the walk got no answer (the state stays what it was)."""
        try:
            # Its own walk: a client's deep health must not wait on (or be
            # answered by) a check that started before the chain changed.
            await self.control.walk(anyio.current_time())
        except MeshnetError as exc:
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "cannot check the chain at %s: %s", self.url, exc)
            self.unanswered = exc.code
            return None
        self.unanswered = None
        problems = self.control.problems
        assert problems is not None
        if problems and problems != self.problems and not self.fail_fast:
            # (at start, meshnet-gateway says it in its one line and exits 2)
            log.error("the chain cannot serve: %s", "; ".join(p.line() for p in problems))
        elif not problems and self.problems:
            log.info("the chain passes its check again")
        self.problems = problems
        entry = self.control.hops[0] if self.control.hops else []
        for report in entry:
            if report.identity is not None and report.identity.layers is not None:
                self.expected_entry = f"{report.identity.model}/{report.identity.layers[0]}"
                break
        return problems

    def changed(self) -> None:
        """A hop's replica set changed (or a request saw a sign of it): check again."""
        if self._recheck is not None:
            self._recheck.set()

    def refuse_if_mismatched(self) -> None:
        """503 ``chain_mismatch`` while the last check found problems."""
        problems = self.problems
        if problems:
            raise CapacityError(
                "the chain cannot serve (wire-2 §6.2): " + "; ".join(p.line() for p in problems),
                code=ErrorCode.CHAIN_MISMATCH,
                retry_after=max(1, math.ceil(self.health_interval)),
            )

    async def readiness(self, started: float) -> None:
        """``GET /health?ready=1``: ready while the last check got an answer
        and found no problem — problems are what every ``/v1`` and
        ``/forward`` request is refused by (``refuse_if_mismatched``), and a
        check unanswered is a chain that would fail them below."""
        if self.problems is None:
            raise not_ready("gateway", "its chain has not answered a check yet")
        if self.unanswered is not None:  # what a request would meet too
            raise not_ready("gateway", f"its last check got no answer ({self.unanswered})")
        if self.problems:
            raise not_ready("gateway", ", ".join(sorted({p.code for p in self.problems})))

    def _fail_fast(self) -> None:
        if self.fail_fast and self.problems:
            raise ChainMismatch(self.problems)

    async def _check_at_start(self) -> None:
        for attempt in range(1, STARTUP_INFO_ATTEMPTS + 1):
            await anyio.sleep(STARTUP_INFO_RETRY_S)
            if self.problems is None:  # the periodic check may have got there
                await self.check(quiet=attempt < STARTUP_INFO_ATTEMPTS)
            if self.problems is not None:
                self._fail_fast()
                return

    async def _recheck_loop(self) -> None:
        """Every health interval, and at once after a change (wire-2 §6.2)."""
        while True:
            assert self._recheck is not None
            with anyio.move_on_after(self.health_interval):
                await self._recheck.wait()
            self._recheck = anyio.Event()
            await self.check(quiet=True)


def gateway_facts(config: GatewayConfig) -> dict[str, Any]:
    """The gateway's own side of the chain check: with ``--model``, its
    checkpoint's id and vocabulary, its context, and that it samples logits."""
    facts: dict[str, Any] = {}
    if config.max_context:
        facts["max_context"] = config.max_context
    if config.model is None:
        return facts
    facts["require_logits"] = True
    from meshnet_gateway.openai.tokenizer import ModelTokenizer
    from meshnet_model.source import is_gguf, load_config

    root = Path(config.model)
    try:
        vocab = ModelTokenizer.load(root).vocab_size
        if is_gguf(root) or (root / "config.json").is_file():
            # A padded embedding (more rows than tokens) is the checkpoint's
            # own choice: the nodes' vocabulary is the config's then.
            vocab = max(vocab, load_config(root).vocab_size)
        facts["vocab"] = vocab
    except (OSError, ValueError) as exc:  # checked again, loudly, by ServedModel.load
        log.warning("cannot read the vocabulary of --model %s: %s", config.model, exc)
    # The same id every stage of this checkpoint reports (wire-2 §6.1): a
    # chain serving another checkpoint, even of the same shape, is refused.
    from meshnet_model.identity import checkpoint_model_id

    try:
        facts["model"] = checkpoint_model_id(root)
    except (OSError, ValueError) as exc:  # checked again, loudly, by ServedModel.load
        log.warning("cannot read the identity of --model %s: %s", config.model, exc)
    return facts

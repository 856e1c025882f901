"""One /v1 generation's moments and token counts, as it goes.

What the access log line says of a generation (TTFT, tok/s) and what the
serving metrics observe (``metrics.ServingMetrics``) come from this one
record, so the two never disagree. Times are the event loop's clock
(``anyio.current_time()``, the clock of ``RequestContext.started``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestTiming"]


@dataclass(slots=True)
class RequestTiming:
    """``arrived``: the request's head was parsed. The rest is filled in as
    the generation passes each point (None: not reached)."""

    arrived: float
    queued: float | None = None  # asked admission
    admitted: float | None = None  # admitted: its first chunk may go down
    first_token: float | None = None  # the first token sampled
    last_token: float | None = None  # the latest token sampled
    prompt_tokens: int | None = None
    completion_tokens: int = 0  # tokens sampled so far (an eos among them, as usage counts)
    finish_reason: str | None = None
    drafted: int = 0  # verify windows' drafted tokens (wire-2 §3.16), and those accepted
    accepted: int = 0
    drafter: str | None = None  # "lookup" or "model" (--draft-model); None: speculation off

    def token(self, now: float) -> float | None:
        """A token was sampled at ``now``: the gap since the one before (None for the first)."""
        gap = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.completion_tokens += 1
        return gap

    @property
    def ttft(self) -> float | None:
        """Time to first token: from the request's arrival (queue and prefill
        included, as vLLM's ``time_to_first_token_seconds``)."""
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first: (tokens - 1) / (last - first),
        the decode speed (llama.cpp's "eval" rate); None under two tokens."""
        if self.first_token is None or self.last_token is None or self.completion_tokens < 2:
            return None
        span = self.last_token - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else None

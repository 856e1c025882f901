"""The official ``openai`` client against a test's gateway, and a bounded
way to call it (it blocks) from an async test."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import openai

LIMIT = 30  # every wait is bounded: a hang fails the test, not the run
T = TypeVar("T")


def client_for(url: str) -> openai.OpenAI:
    """A client of the gateway at ``url``: no retries, bounded waits."""
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=LIMIT,
        # No proxy between the test and loopback, whatever the environment says.
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` in a worker thread, failing the test after ``LIMIT`` seconds."""
    with anyio.fail_after(LIMIT):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

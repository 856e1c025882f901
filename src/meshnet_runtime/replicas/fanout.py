"""Requests a replica set sends to every replica at once: a session's
``DELETE`` (none that ever held it keeps it) and deep health (wire-2 §6.2)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anyio

from meshnet_proto import DownstreamError, ErrorCode, ErrorResponse, MeshnetError, Response

from ..deadlines import Deadline
from .replica import Replica

__all__ = ["delete_everywhere", "deep_health"]


async def delete_everywhere(
    replicas: Sequence[Replica],
    target: str,
    deadline: Deadline,
    headers: Sequence[tuple[bytes, bytes]],
    probe_timeout: float,
) -> Response | ErrorResponse:
    """Every replica, so none that ever held the session keeps it: 204 when
    any knew it, else the first answer; an error only when none answered."""
    answers: list[Response | ErrorResponse] = []
    errors: list[MeshnetError] = []

    async def one(replica: Replica) -> None:
        # A down replica is asked too (a hung one may wake up holding the
        # session), but not waited for longer than a probe.
        mine = deadline
        if not replica.up:
            mine = Deadline.after(min(deadline.remaining(), probe_timeout))
        try:
            answers.append(await replica.pool.request("DELETE", target, mine, headers))
        except MeshnetError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for replica in list(replicas):
            tg.start_soon(one, replica)
    for answer in answers:
        if answer.status == 204:
            return answer
    if answers:
        return answers[0]
    raise errors[0]


async def deep_health(
    stage: str, replicas: Sequence[Replica], deadline: Deadline
) -> dict[str, Any]:
    """Each replica's ``/health?deep=1``: ``ok``, ``degraded`` (some down,
    here or below) or a 502 when none answers (the stage is down)."""
    reports: dict[str, dict[str, Any]] = {}

    async def one(replica: Replica) -> None:
        state = {"state": "mismatch" if replica.mismatch else "ok"}
        if not replica.up:
            # Its probes already fail: asking again would only make this
            # answer (and every level above, which nests) wait for a hang.
            reports[replica.url] = {"up": False, "error": "its health probes fail", **state}
            return
        try:
            response = await replica.pool.request("GET", "/health?deep=1", deadline)
            if isinstance(response, ErrorResponse):
                reports[replica.url] = {"up": False, "error": response.error, **state}
                return
            health = json.loads(response.body)
            reports[replica.url] = {"up": True, "health": health, **state}
        except (MeshnetError, ValueError) as exc:
            reports[replica.url] = {"up": False, "error": str(exc), **state}

    async with anyio.create_task_group() as tg:
        for replica in list(replicas):
            tg.start_soon(one, replica)
    up = [r for r in reports.values() if r["up"]]
    refused = [r for r in reports.values() if _unauthorized(r.get("error"))]
    if not up and not refused:
        raise DownstreamError(
            f"stage {stage} is down: no replica answers", code=ErrorCode.STAGE_DOWN, hop=stage
        )
    # A 401 (another token) or another stage is for the chain check above
    # to name; here it is only not "ok".
    below_degraded = any(
        not isinstance(r["health"], dict) or r["health"].get("status") != "ok" for r in up
    )
    whole = len(up) == len(reports) and not any(r["state"] != "ok" for r in up)
    status = "ok" if whole and not below_degraded else "degraded"
    return {
        "status": status,
        "stage": stage,
        "replicas": [{"url": url, **report} for url, report in sorted(reports.items())],
    }


def _unauthorized(error: Any) -> bool:
    return isinstance(error, dict) and error.get("code") == "unauthorized"

"""The chain in one view (issue 22): every stage in order, with each replica's
URL, layer range, engine, dtype, health and load, as the gateway's ``/info``
``stages``.

The gateway walks the chain the way its requests travel it: from its entry
(one URL, or a replica set whose state it keeps), each hop's ``GET /info``
names the hop below (``downstream``, or ``replicas`` when that hop is a
replica set). Every replica of a hop is asked at once; what a stage reports
of itself comes from its own ``/info`` (``stage``: the backend's
``describe()``, ``identity``: wire-2 §6.1), its health and in-flight count
from the hop above when that hop keeps a replica set.

Bounded, so that a broken chain never turns ``/info`` into a 500 or a hang:
at most ``MAX_STAGES`` stages and ``MAX_REPLICAS`` replicas a stage, each
``/info`` within ``HOP_TIMEOUT``, the whole walk within ``WALK_TIMEOUT``;
a replica that does not answer is shown ``unreachable`` with the reason,
and the walk stops at a stage none of whose replicas answered (what lies
below it is unknown), at a URL seen before (a cycle), or at a limit —
``walk.stopped`` says which. One walk at a time, its result kept
``CACHE_S``: a burst of ``/info`` costs each node one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from meshnet_proto import MeshnetError
from meshnet_runtime.downstream import Downstream

from .client import Client

__all__ = ["CACHE_S", "HOP_TIMEOUT", "MAX_REPLICAS", "MAX_STAGES", "WALK_TIMEOUT", "ChainView"]

MAX_STAGES = 64
MAX_REPLICAS = 32
HOP_TIMEOUT = 2.0  # seconds one replica's /info may take
WALK_TIMEOUT = 10.0  # seconds the whole walk may take
CACHE_S = 1.0


class ChainView:
    """Walks the chain below ``pool`` (the gateway's entry) on demand."""

    def __init__(
        self,
        pool: Downstream,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        hop_timeout: float | None = None,
        walk_timeout: float | None = None,
    ) -> None:
        self.pool = pool
        self.token = token
        self.tls_ca = tls_ca
        # None: the module's bounds, read now (not frozen when the module loaded).
        self.hop_timeout = HOP_TIMEOUT if hop_timeout is None else hop_timeout
        self.walk_timeout = WALK_TIMEOUT if walk_timeout is None else walk_timeout
        self._lock: anyio.Lock | None = None  # made on the loop
        self._cached: tuple[float, dict[str, Any]] | None = None

    async def describe(self) -> dict[str, Any]:
        """``{"stages": [...], "walk": {...}}``, at most ``CACHE_S`` old."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:  # concurrent callers share the walk in flight
            cached = self._cached
            if cached is not None and cached[0] > anyio.current_time():
                return cached[1]
            view = await self.walk()
            self._cached = (anyio.current_time() + CACHE_S, view)
            return view

    async def walk(self) -> dict[str, Any]:
        """One walk, uncached."""
        urls, views = _hop(self.pool.url, self.pool.describe())
        stages: list[dict[str, Any]] = []
        seen: set[str] = set()
        stopped: str | None = None
        end = anyio.current_time() + self.walk_timeout
        while urls:
            if len(stages) == MAX_STAGES:
                stopped = f"more than {MAX_STAGES} stages: the walk stops there"
                break
            if seen.intersection(urls):
                stopped = f"stage {len(stages)} is {urls[0]}, seen above: a cycle"
                break
            left = end - anyio.current_time()
            if left <= 0:
                stopped = f"the walk's {self.walk_timeout:g} s ran out before stage {len(stages)}"
                break
            seen.update(urls)
            answers = await self._ask_all(urls, min(self.hop_timeout, left))
            rows = zip(urls, answers, strict=True)
            replicas = [_replica(url, views.get(url), answer) for url, answer in rows]
            stages.append({"stage": len(stages), "replicas": replicas})
            documents = [a for a in answers if isinstance(a, dict)]
            if not documents:
                below = len(stages) - 1
                stopped = f"no replica of stage {below} answered: what is below is unknown"
                break
            urls, views = _below(documents)
        return {
            "stages": stages,
            "walk": {
                "complete": stopped is None,
                "stopped": stopped,
                "max_stages": MAX_STAGES,
                "hop_timeout_s": self.hop_timeout,
            },
        }

    async def _ask_all(self, urls: Sequence[str], timeout: float) -> list[dict[str, Any] | str]:
        answers: list[dict[str, Any] | str] = ["not asked"] * len(urls)

        async def ask(index: int, url: str) -> None:
            answers[index] = await self._ask(url, timeout)

        async with anyio.create_task_group() as tg:
            for index, url in enumerate(urls):
                tg.start_soon(ask, index, url)
        return answers

    async def _ask(self, url: str, timeout: float) -> dict[str, Any] | str:
        """The replica's /info, or why there is none (one line)."""
        try:
            client = Client(url, token=self.token, tls_ca=self.tls_ca, max_connections=1)
        except (ValueError, OSError) as exc:
            return f"bad URL: {exc}"
        try:
            with anyio.fail_after(timeout):
                return await client.info(timeout=timeout)
        except TimeoutError:
            return f"no answer within {timeout:g} s"
        except (MeshnetError, OSError, ValueError) as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return text.removeprefix(f"{url}: ")[:200]  # the row names the URL already
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


def _hop(url: str, replicas: dict[str, Any] | None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """A hop's replica URLs and the hop above's view of each (a replica set's
    ``describe()``; None for a single node: its URL alone, no view)."""
    if not isinstance(replicas, dict) or not isinstance(replicas.get("replicas"), list):
        return [url], {}
    views = {
        str(r["url"]): r
        for r in replicas["replicas"][:MAX_REPLICAS]
        if isinstance(r, dict) and isinstance(r.get("url"), str)
    }
    return list(views), views


def _below(documents: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The hop below a stage, from its replicas' /info (every URL any of them
    names, in order: replicas of one stage should agree, and the chain check
    says so when they do not)."""
    urls: list[str] = []
    views: dict[str, dict[str, Any]] = {}
    for document in documents:
        downstream = document.get("downstream")
        if not isinstance(downstream, str) or not downstream:
            continue
        hop_urls, hop_views = _hop(downstream, document.get("replicas"))
        for url in hop_urls:
            if url not in urls and len(urls) < MAX_REPLICAS:
                urls.append(url)
                if url in hop_views:
                    views[url] = hop_views[url]
    return urls, views


def _replica(url: str, view: dict[str, Any] | None, answer: dict[str, Any] | str) -> dict[str, Any]:
    """One replica's row: what it says of itself, and what the hop above sees."""
    row: dict[str, Any] = {"url": url}
    if isinstance(answer, str):
        row.update(health="unreachable", error=answer)
    else:
        stage = _dict(answer.get("stage"))
        identity = _dict(answer.get("identity"))
        layers = identity.get("layers", stage.get("layers"))
        row.update(
            health="ok",
            role=answer.get("role"),
            backend=stage.get("backend"),
            model=stage.get("model", identity.get("model")),
            layers=layers if isinstance(layers, list) else None,
            engine=stage.get("engine", identity.get("engine")),
            dtype=stage.get("compute_dtype", identity.get("dtype")),
            # How the matrices are held (int4pack for a quantized GGUF stage on
            # torch, whose compute dtype is float32), else the weights' dtype.
            weights=_dict(stage.get("footprint")).get("form", stage.get("weights_dtype")),
            device=stage.get("device"),
            sessions=answer.get("sessions"),
            kv_sessions=stage.get("kv_sessions"),
            kv_bytes_in_use=stage.get("kv_bytes_in_use"),
        )
    # The hop above's replica set: its probes and its requests in flight.
    if view is not None:
        row["inflight"] = view.get("inflight")
        if not view.get("up", True) and row["health"] == "ok":
            row["health"] = "down"  # answers /info, yet fails the hop's probes
        if view.get("retired"):
            row["health"] = "retired"
        if view.get("mismatch"):
            row["mismatch"] = view.get("mismatch")
    else:
        # A single node: its own count of chunks admitted and not yet answered.
        row["inflight"] = None if isinstance(answer, str) else answer.get("inflight")
    return row


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}

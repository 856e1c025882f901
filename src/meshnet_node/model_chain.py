"""Driving a chain of model nodes over wire 2 (tests, benchmarks, examples).

``start_model_chain(checkpoint, splits)`` starts in-process nodes on
loopback, one per layer range, each pointing at the next; ``ModelSession``
sends a session's prompt in chunks and its decode steps, and returns the
logits the last node answers. The gateway does the same with a tokenizer
in front; this is the bare contract, for checking it.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import numpy as np

from meshnet_model.split import even_splits  # re-exported: the one split (meshnet_model.split)
from meshnet_proto import ActivationResponse, WireHeaders, encode_for_wire
from meshnet_proto.lowlevel import decode_tensor
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool, key_headers

from .config import NodeConfig
from .model_stage import stage_from_config
from .serving import RunningNode, serve_node

__all__ = ["ChainError", "ModelSession", "even_splits", "start_model_chain"]


class ChainError(Exception):
    """The chain answered an error (status, code and message in the text)."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: int | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.retry_after = status, code, retry_after


@asynccontextmanager
async def start_model_chain(
    checkpoint: str | Path,
    splits: Sequence[tuple[int, int]],
    *,
    extra: Sequence[str] = (),
    per_node: Sequence[Sequence[str]] | None = None,
    load_in_thread: bool = False,
) -> AsyncIterator[list[RunningNode]]:
    """Nodes for ``splits`` (entry first), started last-first over loopback TCP.

    ``load_in_thread``: each stage loads in a worker thread, so the event loop
    stays free meanwhile — ``meshnet run`` answers a Ctrl-C during a load of
    minutes at once (the cancelled load is abandoned with the process)."""
    async with AsyncExitStack() as stack:
        nodes: list[RunningNode] = []
        for i in reversed(range(len(splits))):
            start, end = splits[i]
            argv = [
                "--port",
                "0",
                "--model",
                str(checkpoint),
                "--layers",
                f"{start}:{end}",
                *extra,
                *(per_node[i] if per_node else ()),
            ]
            if nodes:
                argv += ["--next", nodes[0].url]
            config = NodeConfig.load(argv, {})
            stage = None
            if load_in_thread:
                stage = await anyio.to_thread.run_sync(
                    stage_from_config, config, abandon_on_cancel=True
                )
            node = await stack.enter_async_context(serve_node(config, stage=stage))
            nodes.insert(0, node)
        yield nodes


class ModelSession:
    """One session's context through a chain: prefill in chunks, then decode steps."""

    def __init__(
        self,
        pool: DownstreamPool,
        session: str | None = None,
        *,
        timeout: float = 60.0,
        key: str | None = None,
    ) -> None:
        """``key``: the session's key (wire-2 §3.9); a new session gets one of
        its own, so nobody who learns its id can continue or end it."""
        self.pool = pool
        self.key = key if key is not None or session is not None else secrets.token_hex(16)
        self.session = session or str(uuid.uuid4())
        self.position = 0
        self.timeout = timeout

    async def run(
        self, ids: np.ndarray, chunk_tokens: int | None = None, *, inflight: int = 1
    ) -> np.ndarray:
        """Send ``ids`` ``[batch, tokens]`` as one run of chunks; the last chunk's logits.

        ``inflight`` > 1 keeps that many chunks on the way at once (the entry
        node's reorder window bounds it): node k computes chunk i+1 while chunk
        i is further down the chain — pipelined prefill. The first error ends
        the run (the chain's context is then unknown: delete the session).
        """
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        tokens = ids.shape[1]
        step = chunk_tokens or tokens
        bounds = list(range(0, tokens, step))
        start = self.position
        if inflight <= 1:
            logits: np.ndarray | None = None
            for index, lo in enumerate(bounds):
                logits = await self.send(ids[:, lo : lo + step], index, len(bounds))
            assert logits is not None
            return logits
        answers: dict[int, np.ndarray] = {}
        failures: list[ChainError] = []
        slots = anyio.Semaphore(inflight)

        async def one(index: int, lo: int, scope: anyio.CancelScope) -> None:
            try:
                answers[index] = await self._post(
                    ids[:, lo : lo + step], index, len(bounds), start + lo
                )
            except ChainError as exc:
                failures.append(exc)
                scope.cancel()
            finally:
                slots.release()

        async with anyio.create_task_group() as tg:
            for index, lo in enumerate(bounds):
                await slots.acquire()
                tg.start_soon(one, index, lo, tg.cancel_scope)
        if failures:
            raise failures[0]
        self.position = start + tokens
        return answers[len(bounds) - 1]

    async def decode(self, token: int | Sequence[int]) -> np.ndarray:
        """One decode step: a new run of a single ``[batch, 1]`` chunk."""
        column = np.asarray([token] if np.isscalar(token) else token, np.int32).reshape(-1, 1)
        return await self.send(column, 0, 1)

    async def send(self, chunk: np.ndarray, index: int, total: int) -> np.ndarray:
        """One chunk of a run at the session's position; its answer, decoded."""
        answer = await self._post(chunk, index, total, self.position)
        self.position += chunk.shape[1]
        return answer

    async def _post(self, chunk: np.ndarray, index: int, total: int, position: int) -> np.ndarray:
        dtype, encoding, body = encode_for_wire(chunk)
        headers = WireHeaders(
            shape=chunk.shape,
            dtype=dtype,
            session=self.session,
            chunk_index=index,
            chunk_total=total,
            encoding=encoding,
            position=position,
            session_key=self.key,
        )
        response = await self.pool.forward(headers, body, Deadline.after(self.timeout))
        if not isinstance(response, ActivationResponse):
            error = response.error
            raise ChainError(
                response.status,
                str(error.get("code")),
                str(error.get("message")),
                response.retry_after,
            )
        return np.array(decode_tensor(response.headers, response.body))

    async def delete(self) -> int:
        response = await self.pool.request(
            "DELETE",
            f"/sessions/{self.session}",
            Deadline.after(self.timeout),
            key_headers(self.key),
        )
        return response.status

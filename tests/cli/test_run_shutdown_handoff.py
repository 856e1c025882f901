"""``meshnet run``'s nodes keep no sessions for a KV hand-off when it shuts
down (issue 43, point 9): its chain lives in one process, so no replica
could take them, and a node's default hand-off window kept a SIGTERM'd
``meshnet run`` waiting up to 10 s for nobody."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from meshnet_cli import run as run_module
from meshnet_node.model_chain import start_model_chain
from meshnet_node.serving import RunningNode
from support.openai import write_model_dir

pytestmark = pytest.mark.anyio


async def test_meshnet_runs_nodes_hold_no_hand_off_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model_dir(tmp_path / "tiny-model")
    started: list[RunningNode] = []

    @asynccontextmanager
    async def recorded(*args: Any, **kwargs: Any) -> AsyncIterator[list[RunningNode]]:
        async with start_model_chain(*args, **kwargs) as nodes:
            started.extend(nodes)
            yield nodes

    monkeypatch.setattr(run_module, "start_model_chain", recorded)
    async with run_module.serve_local(str(model), 2, gateway_flags=["--port", "0"]):
        assert len(started) == 2
        assert [node.server.handoff for node in started] == [None, None]
    # A node started on its own (a replica of a wider chain) keeps its window.
    async with start_model_chain(model, [(0, 4)]) as (alone,):
        assert alone.server.handoff is not None and alone.server.handoff.window == 10.0

"""A model chain with replicas, as processes, for the failover tests.

Stage 1 (layers 0:1) and stage 2 (1:3) each run as two ``meshnet-node``
processes; stage 3 (3:4) as one. Every node and the gateway probe their
replicas every 0.3 s (a probe unanswered for 1.5 s marks a replica down),
so a hung process is found quickly. The ports are picked first so that all
five processes start at once (torch's import dominates their start).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.gateway import clean_env

HEALTH = ["--health-interval", "0.3", "--probe-timeout", "1.5"]


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every socket stays bound until all are picked (one
    closed at once could be handed out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def get_json(url: str, timeout: float = 10.0) -> Any:
    # No proxy between the test and loopback, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:  # the JSON error body says which hop
        raise AssertionError(f"{url}: {exc.code} {exc.read()[:500]!r}") from None


@dataclass
class ReplicaChain:
    model_dir: Path
    stage1: list[str] = field(default_factory=list)  # URLs
    stage2: list[str] = field(default_factory=list)
    stage3: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def node_args(self, url: str) -> list[str]:
        layers, nxt = {
            **{u: ("0:1", ",".join(self.stage2)) for u in self.stage1},
            **{u: ("1:3", ",".join(self.stage3)) for u in self.stage2},
            **{u: ("3:4", "") for u in self.stage3},
        }[url]
        args = ["--model", str(self.model_dir), "--layers", layers, *HEALTH]
        args += ["--port", url.rsplit(":", 1)[1], "--log-level", "warning"]
        return args + (["--next", nxt] if nxt else [])

    def start(self, urls: list[str], timeout: float = 60.0) -> None:
        """Start the nodes of ``urls`` (at once) and wait for their ready lines."""
        for url in urls:
            self.procs[url] = subprocess.Popen(
                [sys.executable, "-m", "meshnet_node", *self.node_args(url)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**clean_env(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
            )
        for url in urls:
            out = self.procs[url].stdout
            assert out is not None
            ready, _, _ = select.select([out], [], [], timeout)
            assert ready, f"{url}: no ready line within {timeout} s"
            assert " listening on " in out.readline()

    def kill(self, url: str, sig: int = signal.SIGKILL) -> None:
        self.procs[url].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[url].wait()

    def info(self, url: str) -> Any:
        return get_json(url + "/info")

    def holder(self, upstream_url: str) -> str:
        """The replica below ``upstream_url`` that holds its one session."""
        held = [r["url"] for r in self.info(upstream_url)["replicas"]["replicas"] if r["sessions"]]
        assert len(held) == 1, held
        return str(held[0])

    def tokens(self, url: str) -> int:
        return int(self.info(url)["stage_tokens"])

    def kv(self, url: str) -> int:
        return int(self.info(url)["stage"]["kv_bytes_in_use"])

    def alive(self) -> list[str]:
        return [url for url, proc in self.procs.items() if proc.poll() is None]


@contextlib.contextmanager
def replica_chain(model_dir: Path) -> Iterator[ReplicaChain]:
    chain = ReplicaChain(model_dir)
    urls = [f"http://127.0.0.1:{port}" for port in free_ports(5)]
    chain.stage1, chain.stage2, chain.stage3 = urls[:2], urls[2:4], urls[4:]
    try:
        chain.start(chain.stage3 + chain.stage2 + chain.stage1)
        yield chain
    finally:
        for proc in chain.procs.values():  # SIGCONT first: a stopped process ignores SIGKILL's wait
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()

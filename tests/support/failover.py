"""A model chain with replicas, as processes, for the failover tests.

Stage 1 (layers 0:1) and stage 2 (1:3) each run as two ``meshnet-node``
processes; stage 3 (3:4) as one. Every node and the gateway probe their
replicas every 0.3 s (a probe unanswered for 1.5 s marks a replica down),
so a hung process is found quickly. Every node binds port 0 and says its
URL on its ready line; a stage's replicas start at once (torch's import
dominates their start), downstream first, since a node's ``--next`` names
the stage below it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
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


def get_json(url: str, timeout: float = 60.0) -> Any:
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
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)  # by URL
    started: list[subprocess.Popen[str]] = field(default_factory=list)  # ready or not
    stages: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # layers, --next

    def node_args(self, layers: str, nxt: list[str], port: int) -> list[str]:
        args = ["--model", str(self.model_dir), "--layers", layers, *HEALTH]
        args += ["--port", str(port), "--log-level", "warning"]
        return args + (["--next", ",".join(nxt)] if nxt else [])

    def start(
        self, count: int, layers: str, nxt: list[str], port: int = 0, timeout: float = 180.0
    ) -> list[str]:
        """Start ``count`` replicas of one stage at once; their URLs, from their ready lines.

        ``timeout`` only bounds a start that never comes (a loaded machine
        imports torch slowly); the ready line is the event waited for.
        """
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "meshnet_node", *self.node_args(layers, nxt, port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**clean_env(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
            )
            for _ in range(count)
        ]
        self.started += procs
        urls = []
        for proc in procs:
            out = proc.stdout
            assert out is not None
            ready, _, _ = select.select([out], [], [], timeout)
            assert ready, f"layers {layers}: no ready line within {timeout} s"
            line = out.readline()
            assert " listening on " in line, line
            url = line.split(" listening on ", 1)[1].split()[0]
            self.procs[url] = proc
            self.stages[url] = (layers, nxt)
            urls.append(url)
        return urls

    def restart(self, url: str) -> None:
        """Start the replica of ``url`` again on its own port (its process is gone).

        The one start that names its port: the test is about a replica that
        comes back where its upstream knows it, and the port is the one its
        killed process just freed.
        """
        layers, nxt = self.stages[url]
        (again,) = self.start(1, layers, nxt, port=int(url.rsplit(":", 1)[1]))
        assert again == url, (again, url)

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
        return int(self.info(url)["stage"]["kv_live_bytes"])  # retained prefixes aside

    def alive(self) -> list[str]:
        return [url for url, proc in self.procs.items() if proc.poll() is None]


@contextlib.contextmanager
def replica_chain(model_dir: Path) -> Iterator[ReplicaChain]:
    chain = ReplicaChain(model_dir)
    try:
        chain.stage3 = chain.start(1, "3:4", [])
        chain.stage2 = chain.start(2, "1:3", chain.stage3)
        chain.stage1 = chain.start(2, "0:1", chain.stage2)
        yield chain
    finally:
        for proc in chain.started:  # SIGCONT first: a stopped process ignores SIGKILL's wait
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()

"""Helpers for the model-surface security tests (issue 13): a model chain of real
processes (two model nodes and a gateway with ``--model``), raw-socket OpenAI
requests, and the readings every attack is judged by — the greedy answer to
a real question, each process's memory, each node's KV bytes.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_model.testing import small_config, write_checkpoint
from support.gateway import clean_env, stop
from support.security import Answer, connect, get, request, rss_kib, send, wire
from support.waiting import holds_within

VOCAB = 320
HIDDEN = 128
CONTEXT = 512
LAYERS = 4
# Big enough that a long prefill keeps a node busy for a while (so a client
# that leaves finds its chunks queued or computing), small enough for CI.
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=512,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=CONTEXT,
)
QUESTION = {"prompt": "hello world, the quick brown fox", "max_tokens": 4, "temperature": 0}


def write_model(root: Path) -> Path:
    write_checkpoint(root, small_config(**MODEL), seed=13)
    write_tokenizer(root, VOCAB)
    return root


def spawn_logged(
    module: str, args: Sequence[str], log: Path, *, timeout: float = 180.0
) -> tuple[subprocess.Popen[str], str]:
    """``python -m module`` with its stderr in ``log`` (never a pipe nobody reads)."""
    err = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=clean_env(),
    )
    err.close()
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if " listening on " not in line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{module}: no ready line ({line!r}); log: {log.read_text()[-2000:]}")
    return proc, line.split(" listening on ", 1)[1].split()[0]


@dataclass
class ModelChain:
    model: str
    gateway: str
    nodes: list[str]  # entry first
    procs: dict[str, subprocess.Popen[str]]  # "node1", "node2", "gateway"
    logs: dict[str, Path]
    answer: str = ""  # the greedy answer to QUESTION, before any attack
    baseline_kib: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def model_chain(
    model_dir: Path,
    logs: Path,
    *,
    node_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
    layers: tuple[str, str] = ("0:2", "2:4"),
) -> Iterator[ModelChain]:
    """node2 (layers 2:4), node1 (0:2, --next node2) and a gateway, as
    processes; ``layers``: another model's split (node1's, node2's)."""
    procs: dict[str, subprocess.Popen[str]] = {}
    paths = {name: logs / f"{name}.log" for name in ("node2", "node1", "gateway")}
    try:
        model = ["--model", str(model_dir), *node_flags]
        procs["node2"], url2 = spawn_logged(
            "meshnet_node", [*model, "--layers", layers[1], "--log-level", "info"], paths["node2"]
        )
        procs["node1"], url1 = spawn_logged(
            "meshnet_node",
            [*model, "--layers", layers[0], "--next", url2, "--log-level", "info"],
            paths["node1"],
        )
        procs["gateway"], gateway = spawn_logged(
            "meshnet_gateway",
            ["--entry", url1, "--model", str(model_dir), "--log-level", "info", *gateway_flags],
            paths["gateway"],
        )
        yield ModelChain(model_dir.name, gateway, [url1, url2], procs, paths)
        for name in ("gateway", "node1", "node2"):
            assert stop(procs[name]) == 0, paths[name].read_text()[-2000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def smollm2_chain(logs: Path) -> Iterator[ModelChain]:
    """The real model (SmolLM2-135M, the packaged GGUF) split 15/15 over two
    node processes behind a gateway, served by the file's stem."""
    from .smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    with model_chain(gguf, logs, layers=("0:15", "15:30")) as run:
        run.model = gguf.stem
        yield run


# ---------------------------------------------------------------- requests


def json_request(path: str, body: bytes | dict, **kwargs) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request([(b"Content-Type", b"application/json")], data, target=path.encode(), **kwargs)


def post(url: str, path: str, body: bytes | dict, *, timeout: float = 120.0) -> Answer:
    # No half-close: the gateway takes a /v1 client that closes its side as
    # one that left, and cancels its generation.
    return send(url, json_request(path, body), timeout=timeout, half_close=False)


def ask(chain: ModelChain, **overrides) -> Answer:
    return post(chain.gateway, "/v1/completions", {"model": chain.model, **QUESTION, **overrides})


def answer_text(answer: Answer) -> str:
    assert answer.status == 200, answer.raw[:600]
    return json.loads(answer.body)["choices"][0]["text"]


def info(url: str) -> dict:
    answer = get(url, "/info")
    assert answer.status == 200, answer.raw[:300]
    return json.loads(answer.body)


def kv_state(chain: ModelChain) -> list[tuple[int, int, int]]:
    """(live sessions' KV bytes, KV sessions, sessions in the table) of each node."""
    states = []
    for url in chain.nodes:
        document = info(url)
        stage = document["stage"]
        states.append((stage["kv_live_bytes"], stage["kv_sessions"], document["sessions"]))
    return states


def wait_for(condition, *, bound: float = 60.0, every: float = 0.1) -> bool:
    """Poll ``condition`` until it holds or ``bound`` seconds pass (no timing claim:
    the bound only ends a test that would otherwise hang)."""
    return holds_within(condition, timeout=bound, every=every)


def rss(chain: ModelChain) -> dict[str, tuple[int, int]]:
    return {name: rss_kib(proc.pid) for name, proc in chain.procs.items()}


def ids_request(
    session: str, ids: np.ndarray, *, position: int | None = None, length: int | None = None
) -> bytes:
    """A /forward chunk of token ids (index 0 of 1) for the first node."""
    shape = ",".join(map(str, ids.shape)).encode()
    pairs = wire(session, shape=shape, dtype=b"int32", position=position)
    body = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    return request(pairs, body, length="auto" if length is None else str(length).encode())


def hidden_request(session: str, hidden: np.ndarray, dtype: bytes = b"float32") -> bytes:
    shape = ",".join(map(str, hidden.shape)).encode()
    return request(wire(session, shape=shape, dtype=dtype), hidden.tobytes())


def disconnect_storm(url: str, data: bytes, events: Sequence[int]) -> None:
    """One client per entry of ``events`` sends ``data`` (a streaming request),
    all at once; each reads that many server-sent events, then drops the
    connection with a reset — so the clients leave at different phases of
    their generation: prefill chunks queued or computing, decode steps on
    their way down the chain."""
    socks = [connect(url, timeout=60) for _ in events]
    try:
        for sock in socks:
            sock.sendall(data)
        seen = [0] * len(socks)
        heads = [False] * len(socks)
        pending = set(range(len(socks)))
        while pending:
            ready, _, _ = select.select([socks[i] for i in pending], [], [], 60)
            assert ready, "no server-sent event within 60 s"
            for sock in ready:
                i = socks.index(sock)
                piece = sock.recv(1 << 16)
                if not heads[i] and piece:  # the first bytes: the answer's status line
                    assert piece.startswith(b"HTTP/1.1 200 "), piece[:300]
                    heads[i] = True
                seen[i] += piece.count(b"data: ")
                if not piece or seen[i] >= events[i]:
                    pending.discard(i)
                    _reset(sock)
    finally:
        for sock in socks:
            _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close with linger 0: a reset, the abrupt way of leaving."""
    if sock.fileno() < 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def health_latencies(url: str, stop_when, *, limit: int = 10_000) -> list[float]:
    """Time ``GET /health`` back to back until ``stop_when()``; the latencies in s."""
    latencies = []
    while not stop_when() and len(latencies) < limit:
        started = time.perf_counter()
        answer = get(url, "/health", timeout=60)
        latencies.append(time.perf_counter() - started)
        assert answer.status == 200
    return latencies

"""Verify windows and rewinds against hostile and careless peers, over real
processes (wire-2 §3.16, with §3.9, §3.10, §3.11 and §7).

Two 2-stage chains of the real model (SmolLM2-135M, layers 0:15 and 15:30)
on the chain's token, prefix cache on, ``--max-chunk-tokens 48`` and
``--reorder-window 4``: the first chain is attacked, the second only takes
a session moved from it. Every session is keyed. Each attack is judged by
its refusal (status, code) and by a reference that never met it — a twin
session fed the same chunks, or a session decoding beside the attack —
whose answers the attacked session's must equal, bit for bit:

1. a stranger's rewind (no token, no key, another key) changes nothing;
2. rewinds to nowhere: an unknown session, a position past ``After``, a
   line that is never reached (it waits, ends at its deadline, drops
   nothing);
3. a rewind into an attached cached prefix is refused, and the cached
   prefix stays what it was;
4. a session moved (KV hand-off) after a rewind keeps its epoch: stale
   windows are refused at both stages there, the new line answers as the
   source did, and a rewind at the source afterwards changes nothing there;
5. floods: a session's waiting windows past the reorder window, a 64-draft
   window past ``--max-chunk-tokens`` (refused from the head), drafts outside
   the vocabulary — each a 4xx; the nodes stay up and another session's
   generation goes on as its reference's.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

from meshnet_proto.lowlevel import prefix_block_keys
from support.security import (
    Answer,
    connect,
    get,
    new_session,
    parse_answer,
    request,
    send,
)
from support.smollm2 import smollm2_gguf
from support.windows_chain import GREEDY, Chunk, chunk_request, node_processes, post, rows

TOKEN = "chain-" + "3c" * 24
PROMPT = [1, 9690, 314, 253, 2914, 30, 1217, 260, 1743, 42, 33, 17, 5]
P = len(PROMPT)
WRONG = [7, 7, 7]  # drafts the model does not predict: a window rejects at its first
LOGPROBS = GREEDY + b",logprobs=2"  # a window's answer as float rows, to compare bit for bit
VOCAB = 49152  # SmolLM2's


@dataclass
class Chains:
    first: str  # layers 0:15, --next last
    last: str  # layers 15:30
    spare_first: str  # layers 0:15, --next spare_last: where a session moves to
    spare_last: str


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chains]:
    # One compute thread each: four processes share the machine's cores.
    limits = ["--max-chunk-tokens", "48", "--reorder-window", "4", "--handoff-window", "0"]
    flags = ["--model", str(smollm2_gguf()), "--threads", "1", *limits, "--log-level", "warning"]
    head, tail = [*flags, "--layers", "0:15"], [*flags, "--layers", "15:30"]
    rounds = [
        [("last", tail, None), ("spare_last", tail, None)],
        [("first", head, "last"), ("spare_first", head, "spare_last")],
    ]
    logs = tmp_path_factory.mktemp("windows-hostile")
    with node_processes(rounds, logs, TOKEN) as urls:
        yield Chains(urls["first"], urls["last"], urls["spare_first"], urls["spare_last"])


class Session:
    """A keyed session entered at ``url``."""

    def __init__(self, url: str, like: Session | None = None) -> None:
        self.url = url
        self.id: str = new_session() if like is None else like.id
        self.key: str = secrets.token_hex(16) if like is None else like.key

    def chunk(self, ids: Sequence[int] | np.ndarray, position: int, **fields: Any) -> Chunk:
        return Chunk(self.id, ids, position, self.key, **fields)

    def send(self, ids: Sequence[int] | np.ndarray, position: int, **fields: Any) -> Answer:
        return post(self.url, self.chunk(ids, position, **fields), TOKEN)

    def window(
        self, ids: list[int], position: int, after: tuple[int, int], sample: bytes = GREEDY
    ) -> Answer:
        """A verify window ``[t, d1 … dk]`` at ``position``: its answer."""
        return self.send(ids, position, after=after, draft=ids[1:], sample=sample)


def argmax(logits: bytes) -> int:
    return int(np.frombuffer(logits, dtype="<f4").argmax())


def tokens(answer: Answer) -> list[int]:
    return np.frombuffer(rows(answer), dtype="<i4").tolist()


def refused(answer: Answer, status: int, code: str, header: str | None = None) -> None:
    assert (answer.status, answer.code) == (status, code), answer.raw[:400]
    if header is not None:
        assert answer.error["header"] == header, answer.error


def twins(url: str) -> tuple[Session, Session, int]:
    """A session and its reference, each fed PROMPT: (them, the greedy next token)."""
    one, other = Session(url), Session(url)
    logits = rows(one.send(PROMPT, 0))
    assert rows(other.send(PROMPT, 0)) == logits
    return one, other, argmax(logits)


# ------------------------------------------------------------------ 1. strangers


def test_a_strangers_rewind_changes_nothing(chains: Chains) -> None:
    victim, twin, g0 = twins(chains.first)
    window = [g0, *WRONG]
    answers = [tokens(s.window(window, P, (P, 0))) for s in (victim, twin)]
    assert answers[0] == answers[1] and len(answers[0]) <= len(WRONG)  # a rejection
    held, at = P + len(window), P + len(answers[0])
    # The rewind a stranger sends: one that would run, were it the owner's.
    rewind = victim.chunk([9, 9], P + 1, after=(held, 1))
    for token, key, status, code in (
        (None, victim.key, 401, "unauthorized"),
        (TOKEN, None, 403, "session_forbidden"),
        (TOKEN, secrets.token_hex(16), 403, "session_forbidden"),
    ):
        stranger = Chunk(rewind.session, rewind.ids, rewind.position, key, after=rewind.after)
        answer = send(chains.first, chunk_request(stranger, token))
        refused(answer, status, code)
        if status == 401:
            assert answer.headers[b"www-authenticate"].lower().startswith(b"bearer")
    # The owner's own rewind, then: the victim answers as its twin, row for row.
    mine, theirs = (
        rows(s.window([answers[0][-1], 5, 6], at, (held, 1), LOGPROBS)) for s in (victim, twin)
    )
    assert mine == theirs


# ------------------------------------------------------------------ 2. nowhere


def test_rewinds_to_nowhere_are_refused_or_wait_and_drop_nothing(chains: Chains) -> None:
    victim, twin, g0 = twins(chains.first)
    # A session the node does not hold: neither a rewind to 0 nor a successor
    # in a later line may start it (at 0 a plain chunk 0 would).
    unknown = Session(chains.first)
    for after in ((P, 1), (0, 1)):
        refused(unknown.send([5], 0, after=after), 409, "session_unknown", "x-meshnet-session")
    # Its own position past the one it follows; an After on a run's chunk 1.
    refused(victim.send([5], P + 2, after=(P, 0)), 400, "bad_after", "x-meshnet-after")
    refused(victim.send([5], P, after=(P, 0), index=1, total=2), 400, "bad_after")
    # A rewind after a position the session never reaches: it waits, and
    # its deadline ends it (the wait's own end, or the request's).
    lost = victim.send([5], 4, after=(P + 50, 1), deadline_ms=1500)
    assert (lost.status, lost.code) in {(409, "chunk_wait_timeout"), (504, "deadline_exceeded")}
    # Nothing was dropped: the next plain chunk at the old position is the twin's.
    assert rows(victim.send([g0], P)) == rows(twin.send([g0], P))


# ------------------------------------------------------------------ 3. the prefix cache


def test_a_rewind_into_an_attached_prefix_is_refused_and_the_prefix_stays(
    chains: Chains,
) -> None:
    rng = np.random.default_rng(16)
    prompt = PROMPT + [int(t) for t in rng.integers(300, 20000, 40 - P)]
    (key,) = prefix_block_keys(prompt)  # the one whole block of 32
    filer = Session(chains.first)
    rows(filer.send(prompt[:32], 0, prefix_blocks=[key]))
    reference = rows(filer.send(prompt[32:], 32))  # the logits after the prompt
    refuser, twin = Session(chains.first), Session(chains.first)
    answers: dict[Session, tuple[list[int], bytes]] = {}
    for session in (refuser, twin):
        assert rows(session.send(prompt[32:], 32, prefix=key)) == reference
        window = tokens(session.window([argmax(reference), *WRONG], 40, (40, 0)))
        if session is refuser:  # to 20: inside the 32 positions it attached
            answer = session.send([3], 20, after=(44, 1))
            refused(answer, 409, "rewind_refused", "x-meshnet-after")
        # Its position (44) and epoch (0) are as before: a plain successor runs.
        answers[session] = window, rows(session.send([5], 44, after=(44, 0)))
    assert answers[refuser] == answers[twin]
    # The cached prefix is what it was: a new session attaching it answers as the filer did.
    late = Session(chains.first)
    assert rows(late.send(prompt[32:], 32, prefix=key)) == reference


# ------------------------------------------------------------------ 4. a move


def export(url: str, session: Session) -> Answer:
    lines = [
        f"GET /kv/{session.id} HTTP/1.1",
        "Host: localhost",
        "Connection: close",
        f"Authorization: Bearer {TOKEN}",
        f"X-Meshnet-Session-Key: {session.key}",
    ]
    return send(url, ("\r\n".join(lines) + "\r\n\r\n").encode())


def import_kv(url: str, exported: Answer, key: str) -> Answer:
    """``POST /forward?kv=1`` of an export, headers and body as received."""
    pairs = [
        (name, value)
        for name, value in exported.headers.items()
        if name.startswith(b"x-meshnet-") or name == b"content-type"
    ]
    pairs.append((b"X-Meshnet-Session-Key", key.encode()))
    return send(url, request(pairs, exported.body, target=b"/forward?kv=1", token=TOKEN))


def hidden_size(url: str) -> int:
    answer = get(url, "/info", token=TOKEN)
    assert answer.status == 200, answer.raw[:300]
    return int(json.loads(answer.body)["identity"]["hidden"])


def test_a_moved_session_keeps_its_epoch(chains: Chains) -> None:
    source = Session(chains.first)
    g0 = argmax(rows(source.send(PROMPT, 0)))
    accepted = tokens(source.window([g0, *WRONG], P, (P, 0)))
    assert len(accepted) <= len(WRONG)
    at = P + len(accepted)
    rows(source.send([accepted[-1]], at, after=(P + 4, 1)))  # the rewind: epoch 1
    held = at + 1
    exports = {url: export(url, source) for url in (chains.first, chains.last)}
    for answer in exports.values():
        assert answer.status == 200, answer.raw[:300]
        assert answer.headers[b"x-meshnet-after"] == b"position=%d,epoch=1" % held
    for url, exported in (
        (chains.spare_first, exports[chains.first]),
        (chains.spare_last, exports[chains.last]),
    ):
        moved = import_kv(url, exported, source.key)
        assert moved.status == 200 and json.loads(moved.body)["position"] == held, moved.raw
    # The source answers the next window of line 1, then rewinds once more.
    window = [42, 43, 44]
    expected = rows(source.window(window, held, (held, 1), LOGPROBS))
    rows(source.send([9], P, after=(held + len(window), 2)))
    target = Session(chains.spare_first, like=source)
    # At the target a window of line 0 is stale, at either stage ...
    refused(target.window(window, held, (held, 0)), 409, "window_stale", "x-meshnet-after")
    states = np.zeros((1, len(window), hidden_size(chains.spare_last)), dtype="<f4")
    stale = target.chunk(states, held, after=(held, 0), draft=window[1:], sample=GREEDY)
    answer = post(chains.spare_last, stale, TOKEN)
    refused(answer, 409, "window_stale", "x-meshnet-after")
    # ... and line 1 goes on there as it did at the source, row for row.
    assert rows(target.window(window, held, (held, 1), LOGPROBS)) == expected


# ------------------------------------------------------------------ 5. floods


class Bystander:
    """A session decoding greedily, one token a step, beside the attacks:
    each step's logits must be those an identical session decoded before
    them, bit for bit."""

    PROMPT: ClassVar[list[int]] = [1, 504, 3458, 282, 4195, 314, 216]

    def __init__(self, url: str, steps: int) -> None:
        reference = Session(url)
        self.logits = [rows(reference.send(self.PROMPT, 0))]
        for step in range(steps):
            at = len(self.PROMPT) + step
            self.logits.append(rows(reference.send([argmax(self.logits[-1])], at)))
        self.session, self.done = Session(url), 0
        assert rows(self.session.send(self.PROMPT, 0)) == self.logits[0]

    def step(self) -> None:
        token, at = argmax(self.logits[self.done]), len(self.PROMPT) + self.done
        self.done += 1
        assert rows(self.session.send([token], at)) == self.logits[self.done]


def head_only(url: str, data: bytes) -> Answer:
    """Send a request's head and none of its body; the answer (one that
    waited for the body would time out: the bound ends the test)."""
    head = data.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    out = b""
    with connect(url, timeout=30) as sock:
        sock.sendall(head)
        while b"\r\n\r\n" not in out or len(out) < _answer_length(out):
            try:
                piece = sock.recv(1 << 16)
            except (TimeoutError, ConnectionResetError):
                break
            if not piece:
                break
            out += piece
    return parse_answer(out)


def _answer_length(raw: bytes) -> int:
    head, _, _ = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


def test_floods_are_refused_and_the_nodes_serve_on(chains: Chains) -> None:
    bystander = Bystander(chains.first, steps=4)

    def serving_on() -> None:
        for url in (chains.first, chains.last):
            assert get(url, "/health").status == 200
        bystander.step()

    flood = Session(chains.first)
    g0 = argmax(rows(flood.send(PROMPT, 0)))
    # Five windows' successors, each following the one before it, all
    # waiting for a chunk at P not sent yet: the window holds 4 waiting.
    waiting = [
        flood.chunk([100 + i], P + i, after=(P + i, 0), deadline_ms=60000) for i in range(1, 6)
    ]
    with ThreadPoolExecutor(len(waiting)) as pool:
        futures = [pool.submit(post, chains.first, chunk, TOKEN) for chunk in waiting]
        done, _ = wait(futures, timeout=60, return_when=FIRST_COMPLETED)
        (excess,) = done
        refused(excess.result(), 409, "chunk_out_of_window")
        serving_on()
        # The missing chunk: the waiting ones run in turn up to the refused
        # one, which is sent again and runs, then the rest.
        rows(flood.send([g0], P, after=(P, 0)))
        j = futures.index(excess)
        for future in futures[:j]:
            rows(future.result(timeout=60))
        rows(post(chains.first, waiting[j], TOKEN))
        for future in futures[j + 1 :]:
            rows(future.result(timeout=60))
    held = P + 6
    # 64 drafts: 65 rows, past --max-chunk-tokens 48: 413 from the head alone.
    big = flood.chunk([5] * 65, held, after=(held, 0), draft=[5] * 64, sample=GREEDY)
    refused(head_only(chains.first, chunk_request(big, TOKEN)), 413, "chunk_too_large")
    serving_on()
    # Drafted ids past the vocabulary (the first stage's input) and past int32.
    refused(flood.window([5, VOCAB, VOCAB + 9000], held, (held, 0)), 400, "bad_stage_input")
    serving_on()
    past_int32 = flood.send([5, 0], held, after=(held, 0), draft=[2**31], sample=GREEDY)
    refused(past_int32, 400, "bad_draft", "x-meshnet-draft")
    serving_on()
    # And the flooded session itself is where it was: a window there runs.
    assert 1 <= len(tokens(flood.window([5, *WRONG], held, (held, 0)))) <= 4

"""The chain check (wire-2 §6.2): do the stages of a chain belong together?

Pure: a node's identity document (wire-2 §6.1) is parsed (``_identity``) into a bounded
``StageIdentity`` (a peer wrote it: junk is a ``ValueError``), a deep health
document into the chain's hops (``chain_from_health``), and ``check_chain``
lists every reason the chain cannot serve — layers that leave a gap, overlap
or come out of order, no stage that makes logits, stages of different
models, a vocabulary other than the gateway's, replicas of one stage that are
not the same stage, a reorder window smaller than what arrives, a context
longer than the model's, a token the next hop refuses, a hop nobody answers.
Stubs (``layers`` null) have no layers to check: only their wire is compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from ._identity import MAX_COUNT, IdentityError, StageIdentity, is_int

__all__ = [
    "CHAIN_PROBLEMS",
    "ChainProblem",
    "IdentityError",
    "StageIdentity",
    "StageReport",
    "chain_from_health",
    "check_chain",
    "is_deep_health",
]

# Every problem code check_chain reports (wire-2 §6.2), in the order found.
CHAIN_PROBLEMS = (
    "layer_gap",
    "layer_overlap",
    "layer_order",
    "no_last_stage",
    "model_mismatch",
    "vocab_mismatch",
    "replica_mismatch",
    "window_too_small",
    "context_too_long",
    "token_mismatch",
    "stage_unreachable",
)

# Bounds on a deep health document (a peer's, never trusted).
MAX_HOPS = 64  # hops a deep health document may nest
MAX_REPLICAS = 64  # replicas one hop may list


@dataclass(frozen=True, slots=True)
class ChainProblem:
    """One reason a chain cannot serve: a code of ``CHAIN_PROBLEMS``, a
    message that names the fix, and where (hop index in chain order, 0 the
    entry, and the replica's URL when one is to blame)."""

    code: str
    message: str
    hop: int | None = None
    url: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "hop": self.hop, "url": self.url}

    def line(self) -> str:
        """The one line a gateway prints when it refuses to start."""
        return f"{self.code}: {self.message}"


@dataclass(frozen=True, slots=True)
class StageReport:
    """One replica of one hop, as the walk saw it.

    ``identity`` is None when it has none to show (it did not answer, or is
    too old to have one); ``problem`` is why, when that is a problem
    (``stage_unreachable``, ``token_mismatch``), or a verdict about it from
    the hop above (``replica_mismatch``: taken out of service there).
    ``url`` is None for the node answering itself.
    """

    url: str | None
    identity: StageIdentity | None = None
    reorder_window: int | None = None
    problem: ChainProblem | None = None


def is_deep_health(query: str) -> bool:
    """Whether a ``/health`` query asks for the deep check (``deep=1``/``true``)."""
    return parse_qs(query).get("deep", ["0"])[-1] in ("1", "true")


# ------------------------------------------------------------------ walking


def chain_from_health(document: Any, url: str | None = None) -> list[list[StageReport]]:
    """The hops of a deep health document (wire-2 §6.2), the answering one first.

    A level is ``{"identity", "reorder_window", "downstream"}``, its
    downstream another level (``"next"`` names its URL), a replica set
    (``{"replicas": [{"url", "up", "health" | "error", "state"}]}``) or, when
    it refused us, ``{"error": {...}}``. Replicas of one hop may each show the
    hop below: the first to show a replica's URL speaks for it.
    """
    hops: list[list[StageReport]] = []
    level: list[tuple[str | None, Any]] = [(url, document)]
    while level:
        if len(hops) == MAX_HOPS:
            raise IdentityError(f"a chain deeper than {MAX_HOPS} hops")
        members: list[StageReport] = []
        below: dict[str | None, Any] = {}
        for where, doc in level:
            report, nested = _level(where, doc, len(hops))
            members.append(report)
            for key, value in nested:
                below.setdefault(key, value)
        hops.append(members)
        level = list(below.items())
    return hops


def _level(url: str | None, doc: Any, hop: int) -> tuple[StageReport, list[tuple[str | None, Any]]]:
    """One replica's report, and what it shows of the hop below."""
    if not isinstance(doc, dict):
        raise IdentityError("a deep health level must be an object")
    if "identity" not in doc and isinstance(doc.get("error"), dict):
        return _refused(url, doc["error"], hop), []
    identity = doc.get("identity")
    parsed = None if identity is None else StageIdentity.from_json(identity)
    window = doc.get("reorder_window")
    if window is not None and (not is_int(window) or not 1 <= window <= MAX_COUNT):
        raise IdentityError(f"reorder_window must be an integer in 1..{MAX_COUNT}")
    problem = None
    if doc.get("state") == "mismatch":
        problem = ChainProblem(
            "replica_mismatch",
            f"{url} serves another stage than the replicas it stands with; "
            "restart it with the same checkpoint, layers and wire flags",
            hop,
            url,
        )
    report = StageReport(url, parsed, window, problem)
    return report, _below(doc.get("downstream"), doc.get("next"))


def _below(downstream: Any, next_url: Any) -> list[tuple[str | None, Any]]:
    if downstream is None:
        return []
    if not isinstance(downstream, dict):
        raise IdentityError("downstream must be an object")
    if not isinstance(next_url, str | None):
        raise IdentityError("next must be a URL")
    replicas = downstream.get("replicas")
    if replicas is None:
        return [(next_url, downstream)]
    if not isinstance(replicas, list) or len(replicas) > MAX_REPLICAS:
        raise IdentityError(f"replicas must be a list of at most {MAX_REPLICAS}")
    out: list[tuple[str | None, Any]] = []
    for replica in replicas:
        if not isinstance(replica, dict) or not isinstance(replica.get("url"), str):
            raise IdentityError("each replica must be an object with its url")
        health = replica.get("health")
        if replica.get("up") and isinstance(health, dict):
            out.append((replica["url"], {**health, "state": replica.get("state")}))
        else:
            error = replica.get("error")
            out.append((replica["url"], {"error": error if isinstance(error, dict) else {}}))
    return out


def _refused(url: str | None, error: dict[str, Any], hop: int) -> StageReport:
    where = url or "the next hop"
    if error.get("code") == "unauthorized":
        problem = ChainProblem(
            "token_mismatch",
            f"{where} refuses the token of the hop above it (401); "
            "give every node and the gateway of one chain the same --token",
            hop,
            url,
        )
    else:
        problem = ChainProblem(
            "stage_unreachable",
            f"{where} does not answer its health check; start it or fix its URL",
            hop,
            url,
        )
    return StageReport(url, None, None, problem)


# ------------------------------------------------------------------ checking


def check_chain(
    hops: Sequence[Sequence[StageReport]],
    *,
    model: str | None = None,
    vocab: int | None = None,
    inflight: int = 1,
    max_context: int | None = None,
    require_logits: bool = False,
) -> list[ChainProblem]:
    """Every reason the chain ``hops`` (in chain order, each hop its
    replicas) cannot serve; empty when it can.

    The facts of whoever sends into hop 0: its ``model`` id and tokenizer
    ``vocab`` (a gateway with ``--model``), the most chunks it sends at once
    (``inflight``; hop 0's own window caps it), its ``max_context``, and
    whether it samples tokens from the chain's output (``require_logits``).
    """
    problems: list[ChainProblem] = []
    stages: list[tuple[int, StageReport]] = []  # one speaker per hop that has one
    for index, members in enumerate(hops):
        speaker = _hop(index, members, problems)
        if speaker is not None:
            stages.append((index, speaker))
    _layers_of(stages, problems)
    _models(stages, model, vocab, problems)
    _windows(stages, inflight, problems)
    if max_context is not None:
        for index, report in stages:
            limit = _identity(report).max_context
            if limit is not None and max_context > limit:
                problems.append(
                    ChainProblem(
                        "context_too_long",
                        f"--max-context {max_context} is above the {limit} tokens hop {index} "
                        f"can hold; lower --max-context to at most {limit}",
                        index,
                        report.url,
                    )
                )
    said = any(p.code == "no_last_stage" for p in problems)  # by the layers: once is enough
    if require_logits and not said and stages and stages[-1][0] == len(hops) - 1:
        index, last = stages[-1]
        if _identity(last).output == "hidden":
            problems.append(
                ChainProblem(
                    "no_last_stage",
                    f"the chain ends at hop {index}, whose output is hidden states, not logits; "
                    "add the stage that ends the model",
                    index,
                    last.url,
                )
            )
    return problems


def _identity(report: StageReport) -> StageIdentity:
    assert report.identity is not None
    return report.identity


# A replica's problems that leave its hop serving when another replica has none.
_DEGRADING = frozenset({"stage_unreachable", "replica_mismatch"})


def _hop(index: int, members: Sequence[StageReport], problems: list[ChainProblem]) -> Any:
    """The hop's own problems; the replica that speaks for it, if any."""
    known = [m for m in members if m.identity is not None and m.problem is None]
    for member in members:
        problem = member.problem
        if problem is None:
            continue
        if problem.code not in _DEGRADING or not any(m.problem is None for m in members):
            # One replica down, or taken out by the hop above for serving
            # another stage, is degraded: the hop serves with the others
            # (failover never moves a session to one taken out). Only a hop
            # with nobody left to answer cannot serve.
            problems.append(ChainProblem(problem.code, problem.message, index, problem.url))
    prints = {_identity(m).fingerprint for m in known}
    if len(prints) > 1:
        urls = ", ".join(str(m.url) for m in known)
        problems.append(
            ChainProblem(
                "replica_mismatch",
                f"the replicas of hop {index} ({urls}) serve different stages; restart them "
                "with the same checkpoint, layers and wire flags",
                index,
            )
        )
    return known[0] if known else None


def _layers_of(stages: list[tuple[int, StageReport]], problems: list[ChainProblem]) -> None:
    ranged = [(i, r, _identity(r)) for i, r in stages if _identity(r).layers is not None]
    if not ranged:
        return
    for (i, _, a), (j, r, b) in itertools.pairwise(ranged):
        assert a.layers is not None and b.layers is not None
        if b.layers[0] < a.layers[0]:
            problems.append(
                ChainProblem(
                    "layer_order",
                    f"hop {j} ({b.describe()}) comes after hop {i} ({a.describe()}); "
                    "order the stages by their first layer",
                    j,
                    r.url,
                )
            )
    # Gaps and overlaps in layer order: an order problem is one problem, not three.
    ordered = sorted(ranged, key=lambda t: _span(t[2]))
    first_index, first, head = ordered[0]
    if _span(head)[0] > 0:
        problems.append(
            ChainProblem(
                "layer_gap",
                f"layers 0:{_span(head)[0]} are served by no stage (the first is hop "
                f"{first_index}, {head.describe()}); add a stage for them",
                first_index,
                first.url,
            )
        )
    for (i, _, a), (j, r, b) in itertools.pairwise(ordered):
        stop, start = _span(a)[1], _span(b)[0]
        if stop < start:
            problems.append(
                ChainProblem(
                    "layer_gap",
                    f"layers {stop}:{start} are served by no stage (hop {i} stops at {stop}, "
                    f"hop {j} starts at {start}); add a stage for them or fix --layers",
                    j,
                    r.url,
                )
            )
        elif stop > start:
            problems.append(
                ChainProblem(
                    "layer_overlap",
                    f"layers {start}:{stop} are served twice (hop {i}: {a.describe()}, hop {j}: "
                    f"{b.describe()}); fix --layers so each stage starts where the one before "
                    "stops",
                    j,
                    r.url,
                )
            )
    last_index, last, tail = ordered[-1]
    if tail.n_layers is not None and _span(tail)[1] < tail.n_layers:
        problems.append(
            ChainProblem(
                "no_last_stage",
                f"layers {_span(tail)[1]}:{tail.n_layers} (and the head that makes logits) are "
                f"served by no stage (the last is hop {last_index}, {tail.describe()}); "
                "add the last stage",
                last_index,
                last.url,
            )
        )


def _span(identity: StageIdentity) -> tuple[int, int]:
    assert identity.layers is not None
    return identity.layers


def _models(
    stages: list[tuple[int, StageReport]],
    model: str | None,
    vocab: int | None,
    problems: list[ChainProblem],
) -> None:
    # A stub has no model to compare: only stages with layers are a model's.
    real = [(i, r, _identity(r)) for i, r in stages if _identity(r).layers is not None]
    if real:
        first_index, _, first = real[0]
        for index, report, ident in real[1:]:
            if ident.model != first.model:
                problems.append(
                    ChainProblem(
                        "model_mismatch",
                        f"hop {index} serves model {ident.model}, hop {first_index} model "
                        f"{first.model}; every stage of a chain must come from one checkpoint",
                        index,
                        report.url,
                    )
                )
        if model is not None and first.model != model:
            problems.append(
                ChainProblem(
                    "model_mismatch",
                    f"the chain serves model {first.model}, the gateway's --model is {model}; "
                    "give the gateway the chain's checkpoint",
                    first_index,
                )
            )
    if vocab is not None:
        for index, report, ident in real:
            if ident.vocab is not None and ident.vocab != vocab:
                problems.append(
                    ChainProblem(
                        "vocab_mismatch",
                        f"hop {index} has a vocabulary of {ident.vocab} tokens, the gateway's "
                        f"tokenizer {vocab}; give the gateway the chain's tokenizer",
                        index,
                        report.url,
                    )
                )
                break


def _windows(
    stages: list[tuple[int, StageReport]], inflight: int, problems: list[ChainProblem]
) -> None:
    arriving = inflight
    for position, (index, report) in enumerate(stages):
        window = report.reorder_window
        if window is None:
            continue
        if position > 0 and window < arriving:
            problems.append(
                ChainProblem(
                    "window_too_small",
                    f"hop {index} reorders {window} chunks, but up to {arriving} arrive at once; "
                    f"give it --reorder-window {arriving} or more (or lower --inflight)",
                    index,
                    report.url,
                )
            )
        arriving = min(arriving, window)

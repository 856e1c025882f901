"""The chain check (wire-2 §6.2), through meshnet_proto's public API only."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_proto import chain_from_health, check_chain
from meshnet_proto._topology import (
    CHAIN_PROBLEMS,
    ChainProblem,
    IdentityError,
    StageIdentity,
    StageReport,
    is_deep_health,
)

MODEL = "a" * 32
OTHER = "b" * 32


def identity(
    layers: tuple[int, int] | None = None,
    *,
    n_layers: int = 30,
    model: str = MODEL,
    fingerprint: str | None = None,
    **fields: Any,
) -> dict[str, Any]:
    if layers is None:
        doc: dict[str, Any] = {
            "model": "stub-echo", "weights": None, "tokenizer": None, "layers": None,
            "n_layers": None, "vocab": None, "hidden": None, "max_context": None,
            "engine": None, "dtype": None, "input": "any", "output": "any",
        }  # fmt: skip
    else:
        doc = {
            "model": model, "weights": "c" * 32, "tokenizer": "d" * 32, "layers": list(layers),
            "n_layers": n_layers, "vocab": 400, "hidden": 64, "max_context": 8192,
            "engine": "numpy", "dtype": "float32",
            "input": "tokens" if layers[0] == 0 else "hidden",
            "output": "logits" if layers[1] == n_layers else "hidden",
        }  # fmt: skip
    doc.update(wire_dtype="keep", encoding="mirror")
    doc.update(fields)
    doc["fingerprint"] = fingerprint or (f"{hash(repr(sorted(doc.items()))) & (2**128 - 1):032x}")
    return doc


def report(url: str, *args: Any, window: int | None = 16, **kw: Any) -> StageReport:
    return StageReport(url, StageIdentity.from_json(identity(*args, **kw)), window)


def chain(*ranges: tuple[int, int], n_layers: int = 30) -> list[list[StageReport]]:
    return [[report(f"http://n{i}", r, n_layers=n_layers)] for i, r in enumerate(ranges)]


def codes(problems: list[ChainProblem]) -> list[str]:
    assert all(p.code in CHAIN_PROBLEMS and p.message for p in problems)
    return [p.code for p in problems]


# ------------------------------------------------------------------ identity


def test_an_identity_round_trips_its_fields() -> None:
    parsed = StageIdentity.from_json(identity((0, 15)))
    assert parsed.layers == (0, 15) and parsed.n_layers == 30 and parsed.input == "tokens"
    assert parsed.describe() == f"{MODEL[:12]} layers 0:15"
    stub = StageIdentity.from_json(identity())
    assert stub.layers is None and stub.describe() == "stub-echo" and stub.weights is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fingerprint": "XYZ"}, "fingerprint"),
        ({"fingerprint": None}, "fingerprint"),
        ({"model": "m" * 101}, "model"),
        ({"model": ""}, "model"),
        ({"weights": 7}, "weights"),
        ({"n_layers": 0}, "n_layers"),
        ({"n_layers": True}, "n_layers"),
        ({"vocab": 2**40}, "vocab"),
        ({"layers": [0, 31]}, "layers"),
        ({"layers": [5, 4]}, "layers"),
        ({"layers": [0]}, "layers"),
        ({"layers": "0:4"}, "layers"),
        ({"layers": [0, 1.5]}, "layers"),
        ({"layers": [0, 4], "n_layers": None}, "layers"),
        ({"input": "pictures"}, "input"),
        ({"output": None}, "output"),
        ({"encoding": None}, "encoding"),
    ],
)
def test_junk_in_an_identity_is_refused_by_name(change: dict[str, Any], named: str) -> None:
    doc = {**identity((0, 15)), **change}
    with pytest.raises(IdentityError, match=f"identity.{named}"):
        StageIdentity.from_json(doc)
    assert issubclass(IdentityError, ValueError)


def test_an_identity_must_be_an_object() -> None:
    with pytest.raises(IdentityError, match="must be an object"):
        StageIdentity.from_json([1, 2])


# ------------------------------------------------------------------ layers


def test_a_whole_chain_has_no_problems() -> None:
    assert check_chain(chain((0, 10), (10, 20), (20, 30)), require_logits=True) == []
    assert check_chain([]) == []


def test_a_gap_an_overlap_and_a_wrong_order_are_named() -> None:
    (gap,) = check_chain(chain((0, 14), (15, 30)))
    assert (gap.code, gap.hop, gap.url) == ("layer_gap", 1, "http://n1")
    assert "14:15" in gap.message and gap.line().startswith("layer_gap: ")
    assert codes(check_chain(chain((0, 15), (10, 30)))) == ["layer_overlap"]
    (order,) = check_chain(chain((0, 10), (20, 30), (10, 20)))
    assert (order.code, order.hop) == ("layer_order", 2)


def test_no_first_and_no_last_stage() -> None:
    (first,) = check_chain(chain((5, 30)))
    assert first.code == "layer_gap" and "0:5" in first.message
    (last,) = check_chain(chain((0, 10), (10, 20)), require_logits=True)
    assert (last.code, last.hop) == ("no_last_stage", 1)


def test_a_hidden_output_at_the_end_is_no_last_stage_even_without_layers_left() -> None:
    hops = [[report("http://n0", (0, 30), output="hidden")]]
    assert codes(check_chain(hops, require_logits=True)) == ["no_last_stage"]
    assert check_chain(hops) == []


def test_stubs_skip_the_layer_and_model_checks() -> None:
    hops = [[report("http://a")], [report("http://b", model="x")], [report("http://c")]]
    assert check_chain(hops, model=MODEL, vocab=7, max_context=10**6, require_logits=True) == []


# ------------------------------------------------------------------ model and vocab


def test_another_checkpoint_and_the_gateways_model_and_vocab() -> None:
    hops = chain((0, 15), (15, 30))
    hops[1] = [report("http://n1", (15, 30), model=OTHER)]
    (other,) = check_chain(hops)
    assert (other.code, other.hop) == ("model_mismatch", 1)
    (mine,) = check_chain(chain((0, 30)), model=OTHER)
    assert mine.code == "model_mismatch" and OTHER in mine.message
    (vocab,) = check_chain(chain((0, 15), (15, 30)), vocab=320)
    assert vocab.code == "vocab_mismatch" and "320" in vocab.message
    assert check_chain(chain((0, 30)), model=MODEL, vocab=400) == []
    assert check_chain([[report("http://n0", (0, 30), vocab=None)]], vocab=320) == []


def test_context_longer_than_the_models() -> None:
    (long,) = check_chain(chain((0, 30)), max_context=100_000)
    assert long.code == "context_too_long" and "8192" in long.message
    assert check_chain(chain((0, 30)), max_context=8192) == []
    assert check_chain([[report("http://n0", (0, 30), max_context=None)]], max_context=9) == []


# ------------------------------------------------------------------ windows


def test_a_smaller_window_deeper_in_the_chain() -> None:
    hops = [[report("http://a", window=16)], [report("http://b", window=4)]]
    (small,) = check_chain(hops, inflight=8)
    assert (small.code, small.hop, small.url) == ("window_too_small", 1, "http://b")
    # The entry's own window caps what the sender sends: never a problem there.
    assert check_chain([[report("http://a", window=2)], [report("http://b", window=2)]],
                       inflight=8) == []  # fmt: skip
    assert check_chain([[report("http://a", window=None)], [report("http://b", window=1)]]) == []


# ------------------------------------------------------------------ replicas


def test_replicas_of_one_hop_must_be_one_stage() -> None:
    a = report("http://a", (0, 30))
    same = report("http://b", (0, 30))
    other = report("http://c", (0, 30), model=OTHER)
    assert check_chain([[a, same]]) == []
    (mismatch,) = check_chain([[a, other]])
    assert mismatch.code == "replica_mismatch" and "http://c" in mismatch.message


def test_a_down_replica_is_degraded_but_a_hop_with_nobody_is_unreachable() -> None:
    down = StageReport("http://d", problem=ChainProblem("stage_unreachable", "down", 9, "http://d"))
    assert check_chain([[report("http://a"), down]]) == []
    (gone,) = check_chain([[down]])
    assert (gone.code, gone.hop, gone.url) == ("stage_unreachable", 0, "http://d")
    refused = StageReport("http://r", problem=ChainProblem("token_mismatch", "401"))
    assert codes(check_chain([[report("http://a"), refused]])) == ["token_mismatch"]
    # An old node with no identity: nothing to check, nothing wrong.
    assert check_chain([[StageReport("http://old")], [report("http://b")]]) == []


# ------------------------------------------------------------------ properties


@st.composite
def splits(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    n_layers = draw(st.integers(1, 80))
    cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), max_size=6))) if n_layers > 1 else []
    bounds = [0, *cuts, n_layers]
    return n_layers, list(itertools.pairwise(bounds))


@settings(max_examples=150, deadline=None)
@given(splits())
def test_any_valid_split_has_no_problems(split: tuple[int, list[tuple[int, int]]]) -> None:
    n_layers, ranges = split
    assert check_chain(chain(*ranges, n_layers=n_layers), require_logits=True) == []


@settings(max_examples=150, deadline=None)
@given(splits(), st.data())
def test_any_moved_boundary_is_found(split: tuple[int, list[tuple[int, int]]], data: Any) -> None:
    n_layers, ranges = split
    index = data.draw(st.integers(0, len(ranges) - 1))
    side = data.draw(st.sampled_from([0, 1]))
    start, stop = ranges[index]
    moved = data.draw(st.integers(0, n_layers).filter(lambda v: v != (start, stop)[side]))
    new = (moved, stop) if side == 0 else (start, moved)
    if not new[0] <= new[1]:
        new = (new[1], new[1])  # still a valid range, and still not the split
    ranges[index] = new
    if (start, stop) == new:
        return
    problems = check_chain(chain(*ranges, n_layers=n_layers), require_logits=True)
    assert problems, ranges
    assert set(codes(problems)) <= {"layer_gap", "layer_overlap", "layer_order", "no_last_stage"}


@settings(max_examples=60, deadline=None)
@given(splits(), st.permutations(range(7)))
def test_a_shuffled_split_is_an_order_problem_only(split: Any, order: list[int]) -> None:
    n_layers, ranges = split
    shuffled = [ranges[i] for i in order if i < len(ranges)]
    problems = check_chain(chain(*shuffled, n_layers=n_layers), require_logits=True)
    if shuffled == ranges:
        assert problems == []
    else:
        assert set(codes(problems)) <= {"layer_order", "no_last_stage"} and problems


# ------------------------------------------------------------------ deep health documents


def level(ident: dict[str, Any] | None, window: int = 16, **more: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"status": "ok", "role": "node", "reorder_window": window, **more}
    if ident is not None:
        doc["identity"] = ident
    return doc


def test_a_nested_chain_reads_back_as_hops() -> None:
    last = level(identity((15, 30)))
    entry = level(identity((0, 15)), next="http://last", downstream=last)
    hops = chain_from_health({"status": "ok", "role": "gateway", "downstream": entry,
                              "next": "http://entry"})  # fmt: skip
    assert [[m.url for m in hop] for hop in hops] == [[None], ["http://entry"], ["http://last"]]
    assert hops[0][0].identity is None and hops[2][0].identity.layers == (15, 30)  # type: ignore[union-attr]
    assert check_chain(hops, require_logits=True) == []


def test_replica_sets_in_a_document() -> None:
    stage2 = level(identity((15, 30)))
    replica = {"url": "http://b1", "up": True, "health": stage2}
    taken_out = {"url": "http://b2", "up": True, "state": "mismatch",
                 "health": level(identity((15, 30), model=OTHER))}  # fmt: skip
    down = {"url": "http://b3", "up": False, "error": "its health probes fail"}
    refused = {"url": "http://b4", "up": False, "error": {"code": "unauthorized"}}
    below = {"status": "degraded", "stage": "x", "replicas": [replica, taken_out, down]}
    entry_a = level(identity((0, 15)), downstream=below)
    entry_b = level(identity((0, 15)), downstream={"replicas": [replica, refused]})
    entries = [{"url": "http://a1", "up": True, "health": entry_a},
               {"url": "http://a2", "up": True, "health": entry_b}]  # fmt: skip
    doc = {"downstream": {"replicas": entries}}
    hops = chain_from_health(doc, "http://gw")
    assert [m.url for m in hops[2]] == ["http://b1", "http://b2", "http://b3", "http://b4"]
    found = check_chain(hops)
    # The one taken out above and the down one only degrade the hop (b1
    # serves it); a replica that refuses the token above it is a problem.
    assert codes(found) == ["token_mismatch"]
    assert {p.hop for p in found} == {2}
    # With nobody but the one taken out left, the hop cannot serve.
    alone = level(identity((0, 15)), downstream={"replicas": [taken_out, down]})
    found = check_chain(chain_from_health({"downstream": {"replicas": [
        {"url": "http://a1", "up": True, "health": alone}]}}, "http://gw"))  # fmt: skip
    assert {"replica_mismatch", "stage_unreachable"} <= set(codes(found))


def test_a_refusal_below_a_single_hop() -> None:
    for error, code in (({"code": "unauthorized"}, "token_mismatch"),
                        ({"code": "downstream_unreachable"}, "stage_unreachable")):  # fmt: skip
        doc = level(identity(), next="http://n", downstream={"error": error})
        (problem,) = check_chain(chain_from_health(doc))
        assert (problem.code, problem.hop, problem.url) == (code, 1, "http://n")
    (unnamed,) = check_chain(chain_from_health(level(None, downstream={"error": {}})))
    assert "the next hop" in unnamed.message and unnamed.to_json()["url"] is None


@pytest.mark.parametrize(
    "doc",
    [
        [],
        level(identity(), window=0),
        level(identity(), window=True),
        level(identity(), downstream=[]),
        level(identity(), downstream={}, next=5),
        level(identity(), downstream={"replicas": "all"}),
        level(identity(), downstream={"replicas": [{"up": True}] * 65}),
        level(identity(), downstream={"replicas": [7]}),
        level({"fingerprint": "0" * 32}),
    ],
)
def test_junk_deep_health_documents_are_refused(doc: Any) -> None:
    with pytest.raises(IdentityError):
        check_chain(chain_from_health(doc))


def test_a_document_deeper_than_the_bound_is_refused() -> None:
    doc: dict[str, Any] = level(identity())
    for _ in range(64):
        doc = level(identity(), downstream=doc)
    with pytest.raises(IdentityError, match="deeper than 64"):
        chain_from_health(doc)


def test_is_deep_health() -> None:
    assert is_deep_health("deep=1") and is_deep_health("x=1&deep=true")
    assert not is_deep_health("") and not is_deep_health("deep=0")

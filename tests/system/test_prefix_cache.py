"""The chain's prefix cache over real processes (wire-2 §3.10, issue 23): a
second turn that repeats a ~450-token first turn computes only what is new
at every stage, and answers exactly what a fresh chain answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.model_surface import answer_text, info, model_chain, post, write_model

# 452 tokens of the test tokenizer: the first turn of a chat.
FIRST = ("the quick brown fox jumps over the lazy dog; " * 20)[:810]


def _complete(chain, prompt: str) -> str:
    body = {"model": chain.model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    return answer_text(post(chain.gateway, "/v1/completions", body))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("prefix-model"))


def test_the_second_turn_computes_only_its_suffix_and_equals_a_fresh_chain(
    model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with model_chain(model_dir, tmp_path / "a") as chain:
        reply = _complete(chain, FIRST)
        second = FIRST + reply + " and then the dog slept"
        warm = _complete(chain, second)
        saved = [info(url)["stage"]["prefix_cache"] for url in chain.nodes]
        metrics = post_metrics(chain.nodes[0])
        gateway_metrics = post_metrics(chain.gateway)
    with model_chain(model_dir, tmp_path / "b") as fresh:
        cold = _complete(fresh, second)
        fresh_saved = info(fresh.nodes[0])["stage"]["prefix_cache"]["tokens_saved"]
    assert warm == cold
    # Every stage attached the first turn's whole blocks (at least 448 of its
    # ~450 tokens), so each computed only the suffix.
    for stage in saved:
        assert stage["hits"] == 1 and stage["tokens_saved"] >= 448, saved
    assert fresh_saved == 0
    assert "meshnet_prefix_cache_tokens_saved_total" in metrics
    saved_line = [
        line
        for line in gateway_metrics.splitlines()
        if line.startswith("meshnet_gateway_prefix_tokens_saved_total ")
    ]
    assert saved_line and float(saved_line[0].split()[1]) >= 448


def post_metrics(url: str) -> str:
    from support.security import get

    answer = get(url, "/metrics")
    assert answer.status == 200
    return answer.body.decode()


def test_a_prefix_the_nodes_no_longer_hold_reruns_cold_with_the_same_answer(
    model_dir: Path, tmp_path: Path
) -> None:
    """The nodes keep no ended session's KV (--prefix-cache-bytes 0), so the
    gateway's belief is stale: the node answers 409 prefix_unknown, and the
    prompt runs again, whole, in a new session — the client sees the answer."""
    with model_chain(model_dir, tmp_path, node_flags=["--prefix-cache-bytes", "0"]) as chain:
        first = _complete(chain, FIRST)
        again = _complete(chain, FIRST)
        stages = [info(url)["stage"]["prefix_cache"] for url in chain.nodes]
    assert again == first
    assert stages[0]["misses"] == 1 and stages[0]["hits"] == 0
    assert all(stage["retained"] == 0 and stage["tokens_saved"] == 0 for stage in stages)


def _chunk(session: str, ids: list[int], position: int, **extra: bytes) -> bytes:
    import numpy as np

    from support.security import request, wire

    pairs = wire(session, shape=f"1,{len(ids)}".encode(), dtype=b"int32", position=position)
    pairs += [(f"X-Meshnet-{name}".encode(), value) for name, value in extra.items()]
    return request(pairs, np.asarray(ids, dtype="<i4").tobytes())


def test_hostile_prefix_headers_at_a_real_node(model_dir: Path, tmp_path: Path) -> None:
    """Each is refused from the head or before any compute, with its code; the
    node stays up and answers an honest session exactly as before."""
    import uuid

    from meshnet_proto.lowlevel import prefix_block_keys
    from support.security import send

    ids = list(range(1, 65))
    keys = prefix_block_keys(ids)
    with model_chain(model_dir, tmp_path) as chain:
        entry = chain.nodes[0]
        before = _complete(chain, FIRST)
        cases = [
            # keys that do not name the tokens: the first stage computes its own
            (dict(**{"Prefix-Blocks": prefix_block_keys([7] * 64)[0].encode()}), 0, ids[:32],
             400, "bad_prefix"),
            # a count other than the blocks that end in the chunk
            (dict(**{"Prefix-Blocks": ",".join(keys).encode()}), 0, ids[:32], 400, "bad_prefix"),
            (dict(Prefix=b"not-a-key"), 32, ids[32:], 400, "bad_prefix"),
            (dict(Prefix=keys[0].encode()), 33, ids[32:], 400, "bad_prefix"),  # not block-aligned
            # a prefix nobody computed: refused, nothing run over a missing prefix
            (dict(Prefix=keys[0].encode()), 32, ids[32:], 409, "prefix_unknown"),
        ]  # fmt: skip
        for extra, position, chunk, status, code in cases:
            answer = send(entry, _chunk(str(uuid.uuid4()), chunk, position, **extra))
            assert answer.status == status, (extra, answer.raw[:300])
            assert json.loads(answer.body)["error"]["code"] == code, answer.body
        stage = info(entry)["stage"]
        assert stage["prefix_cache"]["tokens_saved"] == 0
        assert _complete(chain, FIRST) == before

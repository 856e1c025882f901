"""The chain's prefix cache over real processes (wire-2 §3.10, issue 23): a
second turn that repeats a ~450-token first turn computes only what is new
at every stage, and answers exactly what a fresh chain answers."""

from __future__ import annotations

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

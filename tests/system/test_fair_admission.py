"""Fair admission and a request's cost bounded before work, over real
processes (issue 37): two model nodes and a gateway.

* A long prompt no longer holds the chain for its whole prefill: another
  client's 5-token prompt, sent while it runs, is answered within twice
  its time alone plus one of the long prompt's chunks. Before, the long
  prompt (over ``--max-prefill-tokens``) was admitted alone and every other
  admission waited for the end of its prefill (26.6 s against 0.39 s alone,
  on a loaded machine).
* A chat of 50,000 one-character messages (1.6 MB) is refused with 400
  ``array_above_max_length`` as soon as its JSON is parsed, costing the
  gateway no more than the same text in one message — which is served.
  Before, its template was rendered and its 250,000 tokens encoded (10x the
  CPU, ~200 MB) only to be refused for its length.

The model is random (hidden 768): a prefill of 1,000 tokens takes a few
seconds on two cores, enough to tell "between its chunks" from "after it".
Its tokenizer also learnt runs of ``a`` (up to 4,096 in one token), so that
50,000 of them in one message are a prompt of 16 tokens.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_model.testing import small_config, write_checkpoint
from support.model_surface import ModelChain, model_chain, wait_for
from support.openai import post_json
from support.security import rss_kib

VOCAB = 320
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=192,
    max_position_embeddings=1024,
)
CHUNK = 32
LONG = [2 + (7 * i) % 250 for i in range(1000)]  # 32 chunks
SHORT = [5, 17, 33, 61, 90]
GATEWAY = [
    "--chunk-tokens", str(CHUNK),
    # Small: one chunk of prefill in flight at once. Today's tree admits the
    # long prompt alone (it is over the budget) for its whole prefill.
    "--max-prefill-tokens", str(CHUNK),
    # Far above the 50,000-message chat: today's tree then renders and
    # encodes it (what the issue measured) before refusing its length.
    "--max-prompt-chars", "2000000",
    "--no-prefix-cache",  # every measurement computes its whole prompt
]  # fmt: skip


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelChain]:
    root = tmp_path_factory.mktemp("fair-model")
    write_checkpoint(root, small_config(**MODEL), seed=13)
    # runs of "a" are learned first: a 50,000-letter message is a few tokens
    write_tokenizer(root, VOCAB, extra_corpus=["a" * 4096] * 8)
    with model_chain(root, tmp_path_factory.mktemp("fair-logs"), gateway_flags=GATEWAY) as chain:
        yield chain


def first_token(chain: ModelChain, ids: list[int], source: str = "127.0.0.1") -> float:
    """Seconds until the answer holding the first (and only) token."""
    body = {"model": chain.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    status, answer = post_json(chain.gateway, "/v1/completions", body, source=source)
    assert status == 200, answer
    return time.perf_counter() - started


def prefill_in_flight(chain: ModelChain) -> int:
    host, port = chain.gateway.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/info")
        return int(json.loads(conn.getresponse().read())["admission"]["prefill_tokens"])
    finally:
        conn.close()


def test_a_short_prompt_does_not_wait_for_another_clients_long_prefill(
    chain: ModelChain,
) -> None:
    first_token(chain, SHORT)  # warm: the first request pays for imports and allocations
    alone_before = statistics.median(first_token(chain, SHORT) for _ in range(5))
    long_took: list[float] = []
    runner = threading.Thread(target=lambda: long_took.append(first_token(chain, LONG)))
    runner.start()
    try:
        assert wait_for(lambda: prefill_in_flight(chain) > 0, bound=60, every=0.01)
        besides: list[float] = []
        while len(besides) < 3:  # the median of three: one load spike is not the answer
            # Today's tree fails here: the first waited for the whole long prefill.
            assert runner.is_alive(), f"the long prefill ended first: {besides} s"
            besides.append(first_token(chain, SHORT, source="127.0.0.2"))  # another client
        long_running = runner.is_alive()
    finally:
        runner.join(timeout=120)
    assert long_took, "the long prompt was not answered"
    # Alone again, after: the machine's load may have changed meanwhile (the
    # slower of the two is the fairer reference).
    alone = max(alone_before, statistics.median(first_token(chain, SHORT) for _ in range(5)))
    # B waits for at most the one chunk of A's on the chain when it came
    # (the budget holds one chunk; inflight 1): A's time per chunk, the
    # whole chain's. Counted twice: two cores run three processes, and B's
    # own compute is slowed by A's chunk on the other node.
    per_chunk = long_took[0] / (len(LONG) / CHUNK)
    bound = 2 * alone + 2 * per_chunk
    beside = statistics.median(besides)
    print(f"alone {alone:.3f} s, beside {besides} s, long {long_took[0]:.2f} s")
    assert beside <= bound, (besides, alone, long_took[0])
    assert long_running  # B was answered while A's prefill still ran


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def test_a_chat_of_50000_messages_is_refused_cheaply_and_its_text_in_one_is_served(
    chain: ModelChain,
) -> None:
    pid = chain.procs["gateway"].pid
    path = "/v1/chat/completions"

    def chat(*contents: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": text} for text in contents]
        return {"model": chain.model, "messages": messages, "max_tokens": 2, "temperature": 0}

    one, many = chat("a" * 50_000), chat(*["a"] * 50_000)
    assert len(json.dumps(many)) > 1_500_000
    post_json(chain.gateway, path, one)  # warm
    before = cpu_seconds(pid)
    status, answer = post_json(chain.gateway, path, one)
    one_cpu = cpu_seconds(pid) - before
    assert status == 200 and answer["usage"]["prompt_tokens"] < 32, answer

    peak = rss_kib(pid)[1]
    before = cpu_seconds(pid)
    status, answer = post_json(chain.gateway, path, many)
    many_cpu = cpu_seconds(pid) - before
    print(f"one message {one_cpu:.2f} s CPU, 50,000 messages {many_cpu:.2f} s CPU, "
          f"peak RSS +{(rss_kib(pid)[1] - peak) / 1024:.0f} MiB")  # fmt: skip
    assert status == 400, answer
    error = answer["error"]
    assert (error["code"], error["param"]) == ("array_above_max_length", "messages"), error
    assert many_cpu <= 2 * one_cpu + 0.2, (many_cpu, one_cpu)
    assert rss_kib(pid)[1] - peak < 64 * 1024  # KiB: the chat was never rendered
    status, answer = post_json(chain.gateway, path, chat(*["a"] * 16))  # a chat of a few: served
    assert status == 200, answer

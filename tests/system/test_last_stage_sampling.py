"""The last stage draws (issue 36, wire-2 §3.13), on the real model.

SmolLM2-135M-Instruct (Q4_1 GGUF) split over 2 and over 3 nodes; two
gateways over the same chain, one drawing at the last stage (the default)
and one drawing from relayed logits (``--sample-at gateway``, the path
before this issue). Greedy and seeded answers are equal token for token;
the same seed gives the same text on every run; the logprobs agree; and
what the entry node answers its gateway shrinks from the logits to the ids.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_cli.run import serve_local
from meshnet_gateway import open_gateway
from meshnet_gateway.config import GatewayConfig
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are"
TOKENS = 12
QUIET = ["--log-level", "warning"]
# One chunk a token (the counts below): verify windows are tests/system/test_speculation.py's.
PLAIN = ["--speculate", "off"]


def _post(url: str, document: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(document).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


def _bytes_up(node_url: str) -> float:
    """What the entry node has answered its gateway: activation body bytes."""
    with urllib.request.urlopen(node_url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshnet_body_bytes_out_total" and sample.labels == {
                "peer": "upstream"
            }:
                return sample.value
    return 0.0


REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234},
    "min_p": {"temperature": 1.3, "min_p": 0.05, "seed": 99},
    "logprobs": {"temperature": 0, "logprobs": 3},
}


async def _compare(stages: int) -> dict[str, Any]:
    model = str(smollm2_gguf())
    name_of_model = smollm2_gguf().stem
    async with serve_local(
        model, stages, gateway_flags=["--port", "0", *QUIET, *PLAIN], node_flags=QUIET
    ) as run:

        def another_gateway(*flags: str) -> GatewayConfig:
            """A second gateway over the same chain, with ``flags``."""
            base = ["--port", "0", *QUIET, *PLAIN, "--entry", run.node_urls[0], "--model", model]
            return GatewayConfig.load([*base, *flags])

        relaying = another_gateway("--sample-at", "gateway")
        direct = another_gateway("--direct-return", run.node_urls[-1])
        async with open_gateway(relaying) as old, open_gateway(direct) as quick:
            out: dict[str, Any] = {}
            for name, extra in REQUESTS.items():
                document = {"model": name_of_model, "prompt": PROMPT, "max_tokens": TOKENS}
                document.update(extra)
                gateways = (
                    ("new", run.url),
                    ("again", run.url),
                    ("old", old.url),
                    ("direct", quick.url),
                )
                for label, url in gateways:
                    before = await anyio.to_thread.run_sync(_bytes_up, run.node_urls[0])
                    answer = await anyio.to_thread.run_sync(_post, url, document)
                    after = await anyio.to_thread.run_sync(_bytes_up, run.node_urls[0])
                    out[f"{name}.{label}"] = answer["choices"][0]
                    out[f"{name}.{label}.bytes"] = after - before
            assert quick.app.direct is not None
            info = quick.app.info()
            assert info["direct_return"]["url"] == run.node_urls[-1]
            assert info["sample_at"] == "last-stage"
            counts = quick.app.direct
            out["direct.taken"], out["direct.missed"] = counts.taken, counts.missed
            out["direct.skipped"] = counts.skipped
            return out


@pytest.mark.parametrize("stages", [2, 3])
def test_the_last_stage_draws_the_same_tokens_with_a_few_bytes_each(stages: int) -> None:
    out = anyio.run(_compare, stages)
    for name in REQUESTS:
        new, again, old = out[f"{name}.new"], out[f"{name}.again"], out[f"{name}.old"]
        assert new["text"] == old["text"] == again["text"] == out[f"{name}.direct"]["text"], name
        assert new["finish_reason"] == old["finish_reason"]
        # Up from the entry: ids (4 bytes; 32 with 3 logprobs) for each of the
        # prompt's answer and the decode steps, against the 49,152 x 4 logits.
        if name != "logprobs":
            assert out[f"{name}.new.bytes"] <= 4 * TOKENS, name
        assert out[f"{name}.old.bytes"] >= 49152 * 4 * (TOKENS - 1), name
    assert "blue" in out["greedy.new"]["text"].lower() or out["greedy.new"]["text"]
    new, old = out["logprobs.new"]["logprobs"], out["logprobs.old"]["logprobs"]
    assert new["tokens"] == old["tokens"]
    # float32 on the wire: the node's logprobs agree with the gateway's float64 ones.
    for mine, theirs in zip(new["token_logprobs"], old["token_logprobs"], strict=True):
        assert abs(mine - theirs) <= 1e-5 * max(1.0, abs(theirs))
    for mine, theirs in zip(new["top_logprobs"], old["top_logprobs"], strict=True):
        assert list(mine) == list(theirs)
    assert out["logprobs.new.bytes"] <= 32 * TOKENS
    # The direct return polled while it measured the relay's lag; on
    # loopback the relay is as quick, so it went on without polls but its
    # probes (WORTH_S): every step was polled or skipped, none missed.
    steps = len(REQUESTS) * (TOKENS - 1)
    assert out["direct.taken"] >= 1 and out["direct.missed"] == 0
    assert out["direct.taken"] + out["direct.skipped"] == steps

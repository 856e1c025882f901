"""The gateway's OpenAI API end to end, driven by the official ``openai`` client.

Real model nodes (a tiny random Llama split over 2 or 3 nodes) and the
gateway run in-process on loopback (``support.openai``); the sync
``openai`` client runs in a worker thread so the servers keep running on
the test's event loop (trio or asyncio).
"""

from __future__ import annotations

import http.client
import json
import math
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import openai
import pytest

from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_node.backends import Stage
from meshnet_proto import CapacityError
from support.fault import drop_first_attempts
from support.openai import (
    HeldStage,
    Served,
    fake_embed,
    fake_head,
    fake_stages,
    kv_bytes,
    reference_greedy,
    serve_openai,
    write_model_dir,
)
from support.openai_client import LIMIT, client_for, in_thread
from support.waiting import wait_until
from support.wire import http_request

pytestmark = pytest.mark.anyio

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-model", context=256)


def sample(served: Served, name: str, **labels: str) -> float | None:
    """One value of the gateway's /metrics registry."""
    return served.gateway.metrics.registry.get_sample_value(name, labels)


async def sessions_freed(served: Served) -> None:
    """Wait (bounded) until no node holds a session and no generation runs."""
    await wait_until(
        lambda: (
            not any(node.info()["sessions"] for node in served.nodes)
            and not (served.gateway.openai is not None and served.gateway.openai.active)
        ),
        "every session freed",
        timeout=LIMIT,
    )


async def test_models_lists_the_served_checkpoint(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)
        models = await in_thread(client.models.list)
        assert [m.id for m in models.data] == ["tiny-model"]
        assert (await in_thread(client.models.retrieve, "tiny-model")).id == "tiny-model"
        with pytest.raises(openai.NotFoundError):
            await in_thread(client.models.retrieve, "other")
        assert served.gateway.info()["model"] == "tiny-model"
        metrics = served.gateway.metrics.render().decode()
        # Per-endpoint counts with a bounded label: every model id is one label.
        assert 'endpoint="/v1/models",status="200"} 2.0' in metrics
        assert 'endpoint="/v1/models",status="404"} 1.0' in metrics


async def test_greedy_completion_is_the_chains_output_chunked_and_freed(model_dir: Path) -> None:
    """Temperature 0 through 3 model nodes: the text is exactly the greedy
    walk of the whole model in one process; the prompt went down in chunks
    of 4, one decode step per token after the first; every node freed the
    session's KV cache afterwards."""
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "the quick brown fox jumps over the lazy dog"
    prompt_ids = tokenizer.encode(prompt)
    flags = ["--chunk-tokens", "4", "--inflight", "3"]
    async with serve_openai(model_dir, stages=3, gateway_flags=flags) as served:
        client = client_for(served.url)
        result = await in_thread(
            client.completions.create, model="tiny-model", prompt=prompt, max_tokens=12,
            temperature=0,
        )  # fmt: skip
        await sessions_freed(served)
        assert [kv_bytes(node) for node in served.nodes] == [0, 0, 0]
        stages = [node.stage for node in served.nodes]
        outcome = {"endpoint": "completions", "outcome": "length"}
        assert sample(served, "meshnet_openai_generations_total", **outcome) == 1
        assert sample(served, "meshnet_openai_prompt_tokens_total") == len(prompt_ids)
        assert sample(served, "meshnet_openai_completion_tokens_total") == 12
        assert sample(served, "meshnet_openai_prefill_seconds_count") == 1
        assert sample(served, "meshnet_openai_decode_step_seconds_count") == 11
        assert sample(served, "meshnet_openai_active_generations") == 0
    expected = reference_greedy(model_dir, prompt_ids, 12)
    choice = result.choices[0]
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 12)
    assert result.usage.total_tokens == len(prompt_ids) + 12
    prefill_chunks = math.ceil(len(prompt_ids) / 4)
    assert prefill_chunks > 1
    for stage in stages:  # every stage computed each chunk and each step once
        assert stage.calls == prefill_chunks + 11
    assert served.gateway.inflight == 3


async def test_lost_answers_are_retried_without_recomputing_a_token(model_dir: Path) -> None:
    """The first answer to every chunk and decode step is lost between the
    gateway and the entry node: the gateway sends it again (--retries), the
    nodes replay (wire-2 §3), the text is still the exact greedy walk, and no
    stage ran any chunk twice (which would also have doubled its KV)."""
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "the quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    flags = ["--chunk-tokens", "4", "--inflight", "2", "--retries", "2",
             "--retry-backoff-ms", "1"]  # fmt: skip
    async with serve_openai(
        model_dir, gateway_flags=flags, entry_drop=drop_first_attempts(1)
    ) as served:
        result = await in_thread(
            client_for(served.url).completions.create, model="tiny-model", prompt=prompt,
            max_tokens=6, temperature=0,
        )  # fmt: skip
        await sessions_freed(served)
        calls = [node.stage.calls for node in served.nodes]
    assert result.choices[0].text == tokenizer.decode(reference_greedy(model_dir, prompt_ids, 6))
    assert calls == [math.ceil(len(prompt_ids) / 4) + 5] * 2


async def test_streaming_matches_non_streaming_for_the_same_seed(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)
        args = {"model": "tiny-model", "prompt": "hello world", "max_tokens": 20, "seed": 11,
                "temperature": 0.9, "top_p": 0.95, "extra_body": {"top_k": 40}}  # fmt: skip
        whole = await in_thread(client.completions.create, **args)
        events = await in_thread(
            lambda: list(
                client.completions.create(
                    **args, stream=True, stream_options={"include_usage": True}
                )
            )
        )
        await sessions_freed(served)
    text_events = [e for e in events if e.choices]
    streamed = "".join(e.choices[0].text for e in text_events)
    assert streamed == whole.choices[0].text and len(text_events) > 3
    assert text_events[-1].choices[0].finish_reason == "length"
    assert all(e.choices[0].finish_reason is None for e in text_events[:-1])
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 20


async def test_chat_whole_and_streamed(model_dir: Path) -> None:
    tokenizer = ModelTokenizer.load(model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt_ids = tokenizer.encode(tokenizer.render_chat(messages), chat=True)
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)
        whole = await in_thread(
            client.chat.completions.create, model="tiny-model", messages=messages,
            max_tokens=8, temperature=0,
        )  # fmt: skip
        chunks = await in_thread(
            lambda: list(
                client.chat.completions.create(
                    model="tiny-model",
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                )
            )
        )
        await sessions_freed(served)
    expected = tokenizer.decode(reference_greedy(model_dir, prompt_ids, 8))
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


async def test_seeds_reproduce_and_differ(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)

        async def text(**kwargs: Any) -> str:
            result = await in_thread(
                client.completions.create, model="tiny-model", prompt="once upon a time",
                max_tokens=24, **kwargs,
            )  # fmt: skip
            return result.choices[0].text

        assert await text(seed=5) == await text(seed=5)
        assert await text(seed=5) != await text(seed=6)
        assert await text(temperature=0, seed=1) == await text(temperature=0, seed=2)


async def test_stop_sequence_cuts_the_text(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)
        args = {"model": "tiny-model", "prompt": "the lazy dog", "temperature": 0}
        full = (await in_thread(client.completions.create, max_tokens=30, **args)).choices[0]
        # A stop sequence from the middle of what the model writes.
        stop = full.text[10:13]
        cut = full.text[: full.text.find(stop)]
        stopped = (
            await in_thread(client.completions.create, max_tokens=30, stop=[stop, "@@@@"], **args)
        ).choices[0]
        streamed = await in_thread(
            lambda: list(client.completions.create(max_tokens=30, stop=stop, stream=True, **args))
        )
        await sessions_freed(served)
    assert full.finish_reason == "length" and len(full.text) > 13
    assert stopped.text == cut and stopped.finish_reason == "stop"
    assert "".join(e.choices[0].text for e in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


async def test_invalid_requests_get_openai_error_bodies(model_dir: Path) -> None:
    async with serve_openai(model_dir, gateway_flags=["--max-context", "64"]) as served:
        client = client_for(served.url)
        base = {"model": "tiny-model", "prompt": "hi"}
        cases: list[tuple[dict[str, Any], type[Exception], str | None, str | None]] = [
            ({**base, "model": "gpt-4"}, openai.NotFoundError, "model", "model_not_found"),
            ({**base, "max_tokens": -1}, openai.BadRequestError, "max_tokens", "invalid_value"),
            ({**base, "max_tokens": 1000}, openai.BadRequestError, "max_tokens",
             "context_length_exceeded"),
            ({**base, "prompt": "the fox " * 40}, openai.BadRequestError, "prompt",
             "context_length_exceeded"),
            ({**base, "temperature": "hot"}, openai.BadRequestError, "temperature",
             "invalid_type"),
            ({**base, "n": 17}, openai.BadRequestError, "n", "invalid_value"),
            ({**base, "prompt": [5, 9999]}, openai.BadRequestError, "prompt", "invalid_value"),
        ]  # fmt: skip
        for body, error, param, code in cases:
            with pytest.raises(error) as caught:
                await in_thread(client.completions.create, **body)
            assert isinstance(caught.value, openai.APIStatusError)
            detail = caught.value.body
            assert isinstance(detail, dict), detail  # the client unwraps {"error": ...}
            assert detail["param"] == param and detail["code"] == code, (body, detail)
            assert detail["type"] == "invalid_request_error" and detail["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await in_thread(
                client.chat.completions.create, model="tiny-model",
                messages=[{"role": "robot", "content": "beep"}],
            )  # fmt: skip
        assert "unknown role robot" in str(caught.value)

        def raw(body: bytes) -> tuple[int, dict[str, Any]]:
            host, port = served.url.removeprefix("http://").rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=LIMIT)
            try:
                conn.request("POST", "/v1/completions", body=body, headers=JSON)
                response = conn.getresponse()
                return response.status, json.loads(response.read())
            finally:
                conn.close()

        status, document = await in_thread(raw, b"{not json")
        assert status == 400
        assert set(document["error"]) == {"message", "type", "param", "code"}
        await sessions_freed(served)


async def test_refused_requests_never_reach_a_node(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        stages = [node.stage for node in served.nodes]
        client = client_for(served.url)
        for body in ({"model": "x", "prompt": "hi"}, {"model": "tiny-model", "prompt": "hi",
                                                       "top_p": 7}):  # fmt: skip
            with pytest.raises(openai.APIStatusError):
                await in_thread(client.completions.create, **body)
    assert [stage.calls for stage in stages] == [0, 0]


async def leave_mid_stream(served: Served, max_tokens: int, **fields: Any) -> None:
    """Start a streamed completion over a raw socket, read 3 events, hang up."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "model": "tiny-model",
            "prompt": "hello",
            "max_tokens": max_tokens,
            "stream": True,
            "seed": 1,
            **fields,
        }
    ).encode()
    request = http_request("POST", "/v1/completions", JSON, body)
    with anyio.fail_after(LIMIT):
        stream = await anyio.connect_tcp(host, int(port))
        await stream.send(request)
        seen = b""
        while seen.count(b"data: ") < 3:  # the stream is under way
            seen += await stream.receive()
        assert any(node.info()["sessions"] for node in served.nodes)
        await stream.aclose()


async def test_client_disconnect_mid_stream_frees_every_nodes_kv(model_dir: Path) -> None:
    """A client that leaves mid-stream: the session is deleted on every
    model node and their KV caches freed."""
    async with serve_openai(model_dir, stages=3) as served:
        await leave_mid_stream(served, max_tokens=200)
        assert any(kv_bytes(node) for node in served.nodes)  # the caches were in use
        await sessions_freed(served)
        assert [kv_bytes(node) for node in served.nodes] == [0, 0, 0]
        assert all(node.info()["stage"]["kv_sessions"] == 0 for node in served.nodes)
        outcome = {"endpoint": "completions", "outcome": "cancelled"}
        assert sample(served, "meshnet_openai_generations_total", **outcome) == 1


async def cut_short(served: Served, head: HeldStage) -> None:
    """The generation, left by its client, ends (cancelled) while its head
    holds step ``head.at`` shut: short of its 200 tokens by construction, on
    any machine. Every node is freed, and once the gate opens no step runs
    but the one held."""
    await wait_until(lambda: not served.gateway.openai.active, "the generation cancelled")
    ended_at, held = head.calls, head.waiting
    assert ended_at < head.at and held <= 1
    head.gate.set()
    await wait_until(lambda: head.waiting == 0, "the held step over")
    await sessions_freed(served)
    assert head.calls <= ended_at + held
    outcome = {"endpoint": "completions", "outcome": "cancelled"}
    assert sample(served, "meshnet_openai_generations_total", **outcome) == 1


async def test_client_leaving_a_non_streamed_request_cancels_it(model_dir: Path) -> None:
    """Not only streams: a client that gives up on a whole answer (a timeout
    on its side) stops the generation too, and every node is freed."""
    head = HeldStage("fake-head", fake_head, at=6, gate=anyio.Event())
    async with serve_openai(model_dir, stages=[fake_stages(2)[0], head]) as served:
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "tiny-model", "prompt": "hello", "max_tokens": 200}).encode()
        request = http_request("POST", "/v1/completions", JSON, body)
        stream = await anyio.connect_tcp(host, int(port))
        await stream.send(request)
        await wait_until(lambda: head.waiting == 1, "the generation under way, held")
        await stream.aclose()
        await cut_short(served, head)


STRINGS = {"name": "s", "schema": {"type": "array", "items": {"type": "string"}}}


@pytest.mark.parametrize(
    "fields",
    [{}, {"response_format": {"type": "json_schema", "json_schema": STRINGS}}],
    ids=["plain", "json-schema"],
)
async def test_client_disconnect_cancels_the_generation_at_once(
    model_dir: Path, fields: dict[str, Any]
) -> None:
    """A streamed generation, held at its 20th step, is cut short by the
    client's leaving, not run to its 200 tokens; a constrained one (its
    grammar's mask sent with each step) too."""
    head = HeldStage("fake-head", fake_head, at=20, gate=anyio.Event())
    async with serve_openai(model_dir, stages=[*fake_stages(3)[:2], head]) as served:
        await leave_mid_stream(served, max_tokens=200, **fields)
        await cut_short(served, head)


def failing_head(after: int) -> Stage:
    """A last stage that runs out of KV memory on its ``after``-th chunk."""

    def head(tensor: np.ndarray) -> np.ndarray:
        if failing.calls >= after:
            raise CapacityError("KV cache memory is full", code="kv_memory_full", retry_after=5)
        return fake_head(tensor)

    failing = Stage("failing-head", head)
    return failing


async def test_chain_failure_is_an_openai_error_and_frees_the_session(model_dir: Path) -> None:
    stages = [fake_stages(2)[0], failing_head(after=4)]
    # No retries: this is about how a failure is answered (a 503 would
    # otherwise be sent again after its Retry-After; see the lost-answer test).
    async with serve_openai(model_dir, stages=stages, gateway_flags=["--retries", "0"]) as served:
        client = client_for(served.url)
        args = {"model": "tiny-model", "prompt": "hello", "max_tokens": 10, "temperature": 0}
        with pytest.raises(openai.APIStatusError) as caught:
            await in_thread(client.completions.create, **args)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "5"
        detail = caught.value.body
        assert isinstance(detail, dict)
        assert (detail["type"], detail["code"]) == ("server_error", "kv_memory_full")
        assert "KV cache memory is full" in detail["message"]
        await sessions_freed(served)

        # Streamed: the 200 head is out, so the failure comes as an error event.
        stages[1].calls = 0
        pieces: list[str] = []

        def stream() -> None:
            for event in client.completions.create(**args, stream=True):
                pieces.append(event.choices[0].text)

        with pytest.raises(openai.APIError, match="KV cache memory is full") as streamed:
            await in_thread(stream)
        assert not isinstance(streamed.value, openai.APIStatusError)
        # Text of the tokens before the failure arrived first; the 4th chunk failed.
        assert pieces and stages[1].calls == 4
        await sessions_freed(served)
        outcome = {"endpoint": "completions", "outcome": "error"}
        assert sample(served, "meshnet_openai_generations_total", **outcome) == 2


async def test_bearer_token_is_the_api_key(model_dir: Path) -> None:
    async with serve_openai(model_dir, stages=fake_stages(1),
                            gateway_flags=["--token", "s3cret"],
                            node_flags=["--token", "s3cret"]) as served:  # fmt: skip
        client = client_for(served.url)
        with pytest.raises(openai.AuthenticationError):
            await in_thread(client.models.list)
        good = client.with_options(api_key="s3cret")
        result = await in_thread(good.completions.create, model="tiny-model", prompt="hi",
                                 max_tokens=3)  # fmt: skip
        assert result.usage is not None and result.usage.completion_tokens == 3


async def test_concurrent_streams_do_not_mix(model_dir: Path) -> None:
    """Two generations at once on one chain, each its own session: each gets
    exactly the text it gets alone."""
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)

        def streamed(prompt: str) -> str:
            events = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=16,
                                               temperature=0, stream=True)  # fmt: skip
            return "".join(e.choices[0].text for e in events)

        alone = [await in_thread(streamed, p) for p in ("the quick", "a pipeline of")]
        together: list[str] = ["", ""]

        async def one(index: int, prompt: str) -> None:
            together[index] = await in_thread(streamed, prompt)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0, "the quick")
            tg.start_soon(one, 1, "a pipeline of")
        assert together == alone and alone[0] != alone[1]
        await sessions_freed(served)


async def test_logits_that_cannot_be_sampled_are_a_502_naming_the_chain(model_dir: Path) -> None:
    def nan_head(tensor: np.ndarray) -> np.ndarray:
        return np.full((tensor.shape[0], 320), np.nan, dtype=np.float32)

    stages = [fake_stages(2)[0], Stage("nan-head", nan_head)]
    async with serve_openai(model_dir, stages=stages) as served:
        client = client_for(served.url)
        with pytest.raises(openai.APIStatusError) as caught:
            await in_thread(client.completions.create, model="tiny-model", prompt="hi")
        assert caught.value.status_code == 502
        detail = caught.value.body
        assert isinstance(detail, dict) and detail["code"] == "downstream_bad_response"
        assert served.node_urls[0] in detail["message"]
        await sessions_freed(served)


async def test_client_leaving_during_the_prefill_frees_every_node(model_dir: Path) -> None:
    """The chat stream's first event goes out before the prefill; a client
    leaving right then cancels a prefill whose first chunks are already on
    the nodes, and the session is deleted there all the same."""
    entry = HeldStage("fake-embed", fake_embed, at=3, gate=anyio.Event())
    stages = [entry, fake_stages(2)[1]]  # 40 prompt chunks of 1 token; the 3rd held
    async with serve_openai(
        model_dir, stages=stages, gateway_flags=["--chunk-tokens", "1"]
    ) as served:
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        messages = [{"role": "user", "content": "the quick brown fox jumps over the dog"}]
        body = json.dumps({"model": "tiny-model", "messages": messages, "stream": True}).encode()
        request = http_request("POST", "/v1/chat/completions", JSON, body)
        with anyio.fail_after(LIMIT):
            stream = await anyio.connect_tcp(host, int(port))
            await stream.send(request)
            seen = b""
            while b'"role": "assistant"' not in seen:
                seen += await stream.receive()
        await wait_until(lambda: entry.waiting, "chunks on the entry node, held")
        await stream.aclose()
        await wait_until(lambda: not served.gateway.openai.active, "the prefill cancelled")
        assert entry.calls == 2  # cut short while its third chunk was held
        entry.gate.set()
        await wait_until(lambda: not entry.waiting, "the held chunks over")
        await sessions_freed(served)
        # What was in flight at the entry may finish; the prefill went no further.
        assert stages[1].calls <= entry.calls < 40

"""``n`` > 1 over a real chain (a tiny random Llama on 2 model nodes and the
gateway, in-process on loopback), driven by the official ``openai`` client:
greedy choices equal, sampled choices each from their own seed stream,
streamed choices indexed, usage counting every choice, a bound by name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import pytest

from meshnet_gateway.openai.requests import MAX_CHOICES
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from support.openai import Served, reference_greedy, serve_openai, write_model_dir
from support.openai_client import LIMIT, client_for, in_thread
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-model", context=256)


async def sessions_freed(served: Served) -> None:
    await wait_until(
        lambda: (
            not any(node.info()["sessions"] for node in served.nodes)
            and not (served.gateway.openai is not None and served.gateway.openai.active)
        ),
        "every session freed",
        timeout=LIMIT,
    )


async def test_greedy_choices_are_all_the_chains_greedy_output(model_dir: Path) -> None:
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "the quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    async with serve_openai(model_dir) as served:
        result = await in_thread(
            client_for(served.url).completions.create,
            model="tiny-model",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            n=3,
        )
        await sessions_freed(served)
    expected = tokenizer.decode(reference_greedy(model_dir, prompt_ids, 10))
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [expected] * 3
    assert {c.finish_reason for c in result.choices} == {"length"}
    assert result.usage is not None
    # The prompt counts once, every choice's tokens count (as OpenAI counts).
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 30)
    assert result.usage.total_tokens == len(prompt_ids) + 30


async def test_sampled_choices_each_draw_their_own_seed_stream(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)

        async def texts(n: int, seed: int) -> list[str]:
            result = await in_thread(
                client.completions.create,
                model="tiny-model",
                prompt="once upon a time",
                max_tokens=24,
                seed=seed,
                n=n,
            )
            assert [c.index for c in result.choices] == list(range(n))
            return [c.text for c in result.choices]

        three = await texts(3, seed=5)
        assert len(set(three)) == 3, three  # one stream each, not one stream thrice
        assert await texts(3, seed=5) == three  # the same seed: the same choices
        assert await texts(1, seed=5) == three[:1]  # the first choice is n=1's draw
        await sessions_freed(served)


async def test_streamed_choices_are_indexed_and_usage_counts_them_all(model_dir: Path) -> None:
    messages = [{"role": "user", "content": "tell me about foxes"}]
    async with serve_openai(model_dir) as served:
        client = client_for(served.url)
        args: dict[str, Any] = {
            "model": "tiny-model",
            "messages": messages,
            "max_tokens": 12,
            "seed": 9,
            "n": 2,
        }
        whole = await in_thread(client.chat.completions.create, **args)
        chunks = await in_thread(
            lambda: list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **args
                )
            )
        )
        await sessions_freed(served)
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str | None] = {}
    roles = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, named by its index
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role is not None:
            roles.add(choice.index)
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert roles == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert finished == {0: whole.choices[0].finish_reason, 1: whole.choices[1].finish_reason}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens == 24


async def test_n_above_the_bound_is_refused_by_name(model_dir: Path) -> None:
    async with serve_openai(model_dir) as served:
        with pytest.raises(openai.BadRequestError) as caught:
            await in_thread(
                client_for(served.url).completions.create,
                model="tiny-model",
                prompt="hi",
                n=MAX_CHOICES + 1,
            )
    detail = caught.value.body
    assert isinstance(detail, dict)
    assert (detail["param"], detail["code"]) == ("n", "invalid_value")
    assert str(MAX_CHOICES) in detail["message"]

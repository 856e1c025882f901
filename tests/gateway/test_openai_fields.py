"""The OpenAI fields people use (issue 22 part 7): each implemented one
against a direct reference, each refused one by name.

* logprobs: the numbers are the float64 log-softmax of the last stage's raw
  logits (the fake chain's bigram row), whatever temperature and penalties
  do, on both endpoints, streamed and not, parsed by the official client;
* penalties, min_p, logit_bias: the sampler's adjusted logits against a
  plain-Python reference over the same history;
* min_tokens, ignore_eos, stop_token_ids: through ``generate`` with a
  scripted chain;
* every known field that is not implemented: a 400 naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_gateway.openai.defaults import GenerationDefaults
from meshnet_gateway.openai.errors import OpenAIError
from meshnet_gateway.openai.generation import generate
from meshnet_gateway.openai.logprobs import TokenTexts
from meshnet_gateway.openai.requests import REFUSED, parse_chat, parse_completion
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.sampling import Sampler, SamplingParams, log_softmax
from support.openai import BIGRAM, fake_stages, greedy_continuation, serve_openai, write_model_dir
from support.openai_client import client_for, in_thread

# Logprobs the last stage drew travel as float32 (wire-2 §3.13): the budget
# against the float64 reference is float32's rounding, 2**-24 relative.
DRAWN_AT_LAST_STAGE = {"rel": 1e-7, "abs": 1e-9}
LOGITS = np.random.default_rng(5).standard_normal(300).astype(np.float32) * 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer.load(write_tokenizer(tmp_path_factory.mktemp("tok"), 300))


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    row = logits.astype(np.float64)
    return row - np.log(np.sum(np.exp(row - row.max()))) - row.max()


# ------------------------------------------------------------------ logprobs, units


def test_logprobs_are_the_raw_log_softmax_whatever_the_sampling() -> None:
    expected = reference_log_softmax(LOGITS)
    params = SamplingParams(
        temperature=0.3, top_k=5, repetition_penalty=1.7, presence_penalty=1.0, logprobs=4
    )
    sampler = Sampler(params, seed=1)
    sampler.begin([int(np.argmax(LOGITS))])
    token = sampler(LOGITS)
    assert sampler.last is not None and sampler.last.token == token
    assert sampler.last.logprob == pytest.approx(expected[token], abs=1e-12)
    top = np.argsort(-expected, kind="stable")[:4]
    assert [i for i, _ in sampler.last.top] == top.tolist()
    assert [lp for _, lp in sampler.last.top] == pytest.approx(expected[top], abs=1e-12)
    assert np.allclose(log_softmax(LOGITS), expected, atol=1e-12, rtol=0)


def test_non_finite_logits_have_the_floor_logprob() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=3), None)
    sampler(np.array([np.nan, 2.0, -np.inf, 1.0]))
    assert sampler.last is not None
    assert [i for i, _ in sampler.last.top] == [1, 3, 0]  # ties of -inf by id
    assert sampler.last.top[2][1] == -9999.0


def test_token_texts_give_a_byte_tokens_real_bytes(tokenizer: ModelTokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("numbers é and the fox")[1:]
    assert b"".join(bytes(texts(i).bytes) for i in ids) == "numbers é and the fox".encode()
    half = next(i for i in range(tokenizer.vocab_size) if "\ufffd" in texts(i).text)
    assert len(texts(half).bytes) == 1 and texts(half).bytes[0] >= 0x80
    assert texts(tokenizer.eos_id or 0).text == "</s>"  # special tokens shown


# ------------------------------------------------------------------ penalties, units


def reference_adjusted(
    logits: np.ndarray,
    prompt: list[int],
    generated: list[int],
    rep: float,
    presence: float,
    frequency: float,
) -> np.ndarray:
    out = [float(x) for x in logits]
    for i in set(prompt) | set(generated):
        out[i] = out[i] / rep if out[i] > 0 else out[i] * rep
    for i in set(generated):
        out[i] -= frequency * generated.count(i) + presence
    return np.asarray(out)


@pytest.mark.parametrize(
    ("rep", "presence", "frequency"),
    [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.4), (1.2, -1.5, 2.0)],
)
def test_penalties_equal_a_direct_reference(rep: float, presence: float, frequency: float) -> None:
    prompt = [3, 7, 7, 250]
    params = SamplingParams(
        temperature=1.0,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    sampler = Sampler(params, seed=3)
    sampler.begin(prompt)
    generated = []
    rng = np.random.default_rng(0)
    for _ in range(40):
        logits = (rng.standard_normal(300) * 4).astype(np.float32)  # peaked: ids recur
        expected = reference_adjusted(logits, prompt, generated, rep, presence, frequency)
        assert np.allclose(sampler.adjusted(logits), expected, rtol=0, atol=1e-9)
        generated.append(sampler(logits))
    assert len(set(generated)) < len(generated)  # some ids did repeat: the counts were used


def test_repetition_penalty_changes_the_greedy_walk() -> None:
    logits = np.array([5.0, 4.9, 0.0, -1.0])
    plain = Sampler(SamplingParams(temperature=0.0), None)
    plain.begin([0])
    assert plain(logits) == 0
    penalised = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.1), None)
    penalised.begin([0])
    assert penalised(logits) == 1  # 5.0 / 1.1 < 4.9
    assert penalised(np.array([0.0, 4.9, 4.8, 0.0])) == 2  # 1 was generated: 4.9 / 1.1


def test_min_p_keeps_what_reaches_min_p_of_the_best() -> None:
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.5), seed=0)
    assert {sampler(np.log(probs)) for _ in range(400)} == {0, 1, 2}  # >= 0.2
    everything = Sampler(SamplingParams(temperature=1.0), seed=0)
    assert {everything(np.log(probs)) for _ in range(400)} == {0, 1, 2, 3, 4}


def test_logit_bias_is_added_before_the_choice() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=((7, 100.0), (299, -100.0))), None)
    adjusted = sampler.adjusted(LOGITS)
    assert adjusted[7] == pytest.approx(float(LOGITS[7]) + 100.0)
    assert adjusted[299] == pytest.approx(float(LOGITS[299]) - 100.0)
    assert sampler(LOGITS) == 7


def test_the_same_seed_reproduces_with_penalties() -> None:
    def walk(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, frequency_penalty=1.0, min_p=0.05), seed)
        sampler.begin([1, 2])
        return [sampler(LOGITS) for _ in range(30)]

    assert walk(9) == walk(9) != walk(10)


# ------------------------------------------------------------------ stop ids, through generate


class ScriptedChain:
    """A chain whose logits put 10 on ``script[k]`` for the k-th token, 0 elsewhere."""

    def __init__(self, script: list[int], vocab: int = 300) -> None:
        self.script, self.vocab, self.sent = script, vocab, 0

    def _logits(self) -> np.ndarray:
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[self.script[min(self.sent, len(self.script)) - 1]] = 10.0
        return logits

    async def prefill(self, ids: list[int], sample: object = None) -> np.ndarray:
        """Logits whatever ``sample`` asks (a chain that ignores wire-2 §3.13)."""
        self.sent += 1
        return self._logits()

    @contextlib.asynccontextmanager
    async def pipelined(self) -> AsyncIterator[None]:
        yield  # every answer here is immediate: nothing in flight

    async def step(self, token_id: int, sample: object = None) -> np.ndarray:
        self.sent += 1
        return self._logits()


async def run_script(
    tokenizer: ModelTokenizer, script: list[int], max_tokens: int = 20, **params: Any
) -> tuple[Any, list[int]]:
    sampler = Sampler(SamplingParams(temperature=0.0, **params), None)
    chain = ScriptedChain(script)
    result = await generate(
        chain,
        tokenizer,
        [0, 9],
        max_tokens=max_tokens,  # type: ignore[arg-type]
        sampler=sampler,
    )
    return result, result.token_ids


@pytest.mark.anyio
async def test_min_tokens_masks_eos_until_then(tokenizer: ModelTokenizer) -> None:
    eos = tokenizer.eos_id
    assert eos is not None
    word = tokenizer.encode("fox")[-1]
    script = [eos, eos, word, eos]
    plain, _ = await run_script(tokenizer, script)
    assert plain.completion_tokens == 1 and plain.finish_reason == "stop"
    held, ids = await run_script(tokenizer, script, min_tokens=3)
    # eos masked twice: the best other id (0, all zeros, lowest id), then the word.
    assert ids == [0, 0, word] and held.completion_tokens == 4 and held.finish_reason == "stop"


@pytest.mark.anyio
async def test_ignore_eos_generates_through_it(tokenizer: ModelTokenizer) -> None:
    eos = tokenizer.eos_id
    assert eos is not None
    words = tokenizer.encode("the fox")[1:]
    script = [words[0], eos, words[1]]
    stopped, _ = await run_script(tokenizer, script, max_tokens=3)
    assert stopped.finish_reason == "stop" and stopped.completion_tokens == 2
    through, ids = await run_script(tokenizer, script, max_tokens=3, ignore_eos=True)
    assert ids == script and through.finish_reason == "length"
    assert through.text == tokenizer.decode(words[:2])  # eos is special: no text


@pytest.mark.anyio
async def test_stop_token_ids_stop_and_are_not_shown(tokenizer: ModelTokenizer) -> None:
    words = tokenizer.encode("the quick brown fox")[1:]
    result, ids = await run_script(tokenizer, words, stop_token_ids=frozenset({words[2]}))
    assert ids == words[:2] and result.finish_reason == "stop"
    assert result.completion_tokens == 3  # the stop id is counted, as eos is
    _, ids = await run_script(
        tokenizer, words, stop_token_ids=frozenset({words[2]}), ignore_eos=True, min_tokens=3
    )
    assert ids[:2] == words[:2] and ids[2] != words[2]  # masked until min_tokens


# ------------------------------------------------------------------ parsing


def test_request_fields_reach_the_sampling_params() -> None:
    request = parse_completion(
        {
            "model": "m",
            "prompt": "x",
            "max_tokens": 9,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"5": -3, "2": 1},
            "min_tokens": 4,
            "ignore_eos": True,
            "stop_token_ids": [7, 7, 3],
            "logprobs": 2,
            "response_format": {"type": "text"},
            "best_of": 1,
            "suffix": None,
            "echo": False,
            "user": "u",
            "metadata": {"a": "b"},
        }
    )
    assert request.options.sampling == SamplingParams(
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias=((2, 1.0), (5, -3.0)),
        min_tokens=4,
        ignore_eos=True,
        stop_token_ids=frozenset({3, 7}),
        logprobs=2,
    )
    chat = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 20,
        }
    )
    assert chat.options.sampling.logprobs == 20
    assert (
        parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
        ).options.sampling.logprobs
        == 0
    )
    assert (
        parse_chat(
            {"model": "m", "messages": [{"role": "u", "content": "x"}], "logprobs": False}
        ).options.sampling.logprobs
        is None
    )


def error_of(parse: Callable[[dict[str, Any]], object], document: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(document)
    return caught.value


REFUSED_ROWS = [(name, "x") for name in REFUSED] + [
    ("suffix", "tail"),
    ("echo", True),
    ("modalities", ["text", "audio"]),
    ("store", True),
    ("service_tier", "flex"),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_ROWS)
def test_each_known_unimplemented_field_is_refused_by_name(field: str, value: object) -> None:
    for parse, base in (
        (parse_completion, {"model": "m", "prompt": "x"}),
        (parse_chat, {"model": "m", "messages": [{"role": "u", "content": "x"}]}),
    ):
        error = error_of(parse, {**base, field: value})
        assert (error.status, error.param, error.code) == (400, field, "unsupported_parameter")
        assert field in error.message


@pytest.mark.parametrize(
    ("document", "param", "code"),
    [
        ({"best_of": 3}, "best_of", "unsupported_value"),
        ({"best_of": 0}, "best_of", "invalid_value"),
        ({"n": 17}, "n", "invalid_value"),  # above MAX_CHOICES
        ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
            "invalid_value",
        ),
        ({"response_format": "json"}, "response_format", "invalid_type"),
        ({"response_format": {}}, "response_format", "invalid_type"),
        ({"logprobs": 6}, "logprobs", "invalid_value"),
        ({"logprobs": -1}, "logprobs", "invalid_value"),
        ({"logprobs": True}, "logprobs", "invalid_type"),
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({"min_p": 1.1}, "min_p", "invalid_value"),
        ({"min_p": "x"}, "min_p", "invalid_type"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"repetition_penalty": 11}, "repetition_penalty", "invalid_value"),
        ({"repetition_penalty": 0.009}, "repetition_penalty", "invalid_value"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty", "invalid_type"),
        ({"presence_penalty": -2.1}, "presence_penalty", "invalid_value"),
        ({"frequency_penalty": 2.1}, "frequency_penalty", "invalid_value"),
        ({"min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"min_tokens": 1.5}, "min_tokens", "invalid_type"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "invalid_value"),
        ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
        ({"stop_token_ids": 5}, "stop_token_ids", "invalid_type"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids", "invalid_type"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids", "invalid_value"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
        ({"logit_bias": []}, "logit_bias", "invalid_type"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "invalid_type"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_type"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"5": None}}, "logit_bias", "invalid_type"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ],
)
def test_completion_fields_are_bounded_and_typed(
    document: dict[str, Any], param: str, code: str
) -> None:
    error = error_of(parse_completion, {"model": "m", "prompt": "x", **document})
    assert (error.status, error.param, error.code) == (400, param, code)


@pytest.mark.parametrize(
    ("document", "code"),
    [
        ({"top_logprobs": 2}, "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "invalid_value"),
        ({"logprobs": 1}, "invalid_type"),
        ({"logprobs": True, "top_logprobs": "3"}, "invalid_type"),
    ],
)
def test_chat_logprobs_fields_are_bounded(document: dict[str, Any], code: str) -> None:
    error = error_of(
        parse_chat, {"model": "m", "messages": [{"role": "u", "content": "x"}], **document}
    )
    assert error.code == code and error.param in ("logprobs", "top_logprobs")


def test_generation_config_gives_min_p_and_repetition_penalty_defaults() -> None:
    defaults = GenerationDefaults.from_dict({"min_p": 0.1, "repetition_penalty": 1.3})
    given = SamplingParams()
    assert defaults.sampling(given, frozenset()) == SamplingParams(
        min_p=0.1, repetition_penalty=1.3
    )
    mine = SamplingParams(repetition_penalty=1.0)
    assert defaults.sampling(mine, frozenset({"repetition_penalty"})).repetition_penalty == 1.0
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationDefaults.from_dict({"repetition_penalty": 0})


# ------------------------------------------------------------------ through the API


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-model", context=256)


def expected_logprobs(prompt_ids: list[int], ids: list[int]) -> tuple[list[float], list[list[int]]]:
    """What the fake chain's last stage implies: log-softmax of BIGRAM[previous id]."""
    chosen, tops, previous = [], [], prompt_ids[-1]
    for token in ids:
        row = reference_log_softmax(BIGRAM[previous])
        chosen.append(float(row[token]))
        tops.append(np.argsort(-row, kind="stable").tolist())
        previous = token
    return chosen, tops


def penalised_greedy(prompt_ids: list[int], count: int, penalty: float) -> list[int]:
    """The fake chain's greedy walk under a repetition penalty, computed directly."""
    ids: list[int] = []
    previous = prompt_ids[-1]
    for _ in range(count):
        row = [float(x) for x in BIGRAM[previous]]
        for i in set(prompt_ids) | set(ids):
            row[i] = row[i] / penalty if row[i] > 0 else row[i] * penalty
        previous = int(np.argmax(row))
        ids.append(previous)
    return ids


def top_by_text(tokenizer: ModelTokenizer, row: np.ndarray, token: int, k: int) -> dict:
    top: dict[str, float] = {}
    for i in [*np.argsort(-row, kind="stable")[:k].tolist(), token]:
        top.setdefault(tokenizer.tokenizer.decode([i], skip_special_tokens=False), float(row[i]))
    return top


@pytest.mark.anyio
async def test_completions_logprobs_whole_and_streamed(model_dir: Path) -> None:
    """A strong repetition penalty changes the walk (checked against a direct
    reference); the logprobs stay those of the raw logits (vLLM's default)."""
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "the quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    ids = penalised_greedy(prompt_ids, 40, 3.0)
    assert ids != greedy_continuation(prompt_ids, 40)  # the penalty matters here
    chosen, _ = expected_logprobs(prompt_ids, ids)
    texts = [tokenizer.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    args = {
        "model": "tiny-model",
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 3,
        "extra_body": {"repetition_penalty": 3.0},
    }
    async with serve_openai(model_dir, stages=fake_stages(2)) as served:
        client = client_for(served.url)
        whole = await in_thread(client.completions.create, **args)
        events = await in_thread(lambda: list(client.completions.create(**args, stream=True)))
    assert whole.choices[0].text == tokenizer.decode(ids)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == texts
    assert logprobs.token_logprobs == pytest.approx(chosen, abs=1e-9)
    assert logprobs.top_logprobs is not None
    rows = [reference_log_softmax(BIGRAM[p]) for p in [prompt_ids[-1], *ids[:-1]]]
    for k, top in enumerate(logprobs.top_logprobs):
        assert top == pytest.approx(top_by_text(tokenizer, rows[k], ids[k], 3), abs=1e-9)
    offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert logprobs.text_offset == offsets
    streamed = [e.choices[0].logprobs for e in events if e.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in (lp.tokens or [])] == texts
    assert [x for lp in streamed for x in (lp.token_logprobs or [])] == pytest.approx(chosen)
    assert [x for lp in streamed for x in (lp.text_offset or [])] == offsets
    assert "".join(e.choices[0].text for e in events) == whole.choices[0].text


@pytest.mark.anyio
async def test_chat_logprobs_whole_and_streamed(model_dir: Path) -> None:
    tokenizer = ModelTokenizer.load(model_dir)
    messages = [{"role": "user", "content": "hi there"}]
    prompt_ids = tokenizer.encode(tokenizer.render_chat(messages), chat=True)
    ids = greedy_continuation(prompt_ids, 6)
    chosen, tops = expected_logprobs(prompt_ids, ids)
    args = {
        "model": "tiny-model",
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    async with serve_openai(model_dir, stages=fake_stages(2)) as served:
        client = client_for(served.url)
        whole = await in_thread(client.chat.completions.create, **args)
        chunks = await in_thread(lambda: list(client.chat.completions.create(**args, stream=True)))
        plain = await in_thread(
            client.chat.completions.create, **{**args, "logprobs": False, "top_logprobs": None}
        )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert [c.logprob for c in content] == pytest.approx(chosen, **DRAWN_AT_LAST_STAGE)
    rows = [reference_log_softmax(BIGRAM[p]) for p in [prompt_ids[-1], *ids[:-1]]]
    for c, row, top in zip(content, rows, tops, strict=True):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(
            row[top[:5]], **DRAWN_AT_LAST_STAGE
        )
        assert [t.token for t in c.top_logprobs] == [
            tokenizer.tokenizer.decode([i], skip_special_tokens=False) for i in top[:5]
        ]
    joined = b"".join(bytes(c.bytes or []) for c in content)
    assert joined.decode(errors="replace") == tokenizer.decode(ids)  # the exact bytes
    streamed = [
        c
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs is not None
        for c in (ch.choices[0].logprobs.content or [])
    ]
    assert [c.logprob for c in streamed] == pytest.approx(chosen, **DRAWN_AT_LAST_STAGE)
    assert plain.choices[0].logprobs is None


@pytest.mark.anyio
async def test_api_refuses_by_name_and_checks_ids_against_the_vocab(model_dir: Path) -> None:
    async with serve_openai(model_dir, stages=fake_stages(2)) as served:
        client = client_for(served.url)
        for kwargs, param, code in [
            (
                {"tools": [{"type": "function", "function": {"name": "f g"}}]},
                "tools.[0].function.name",
                "invalid_value",
            ),
            ({"response_format": {"type": "yaml"}}, "response_format", "invalid_value"),
            ({"extra_body": {"stop_token_ids": [320]}}, "stop_token_ids", "invalid_value"),
            ({"logit_bias": {"320": 5}}, "logit_bias", "invalid_value"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                await in_thread(
                    client.chat.completions.create,
                    model="tiny-model",
                    messages=[{"role": "user", "content": "x"}],
                    **kwargs,
                )
            body = caught.value.body
            assert isinstance(body, dict) and (body["param"], body["code"]) == (param, code)
        # A field the API does not know at all is still ignored, as before.
        done = await in_thread(
            client.completions.create,
            model="tiny-model",
            prompt="x",
            max_tokens=2,
            extra_body={"my_own_field": 1},
        )
        assert done.usage is not None and done.usage.completion_tokens == 2


# ------------------------------------------------------------------ any accepted value is safe

EXTREME = np.array([3.4e38, -3.4e38, 0.0, 1e-45, -1e-45, 88.0, -88.0, 3.3e38], dtype=np.float32)


@settings(max_examples=80, deadline=None)
@given(
    temperature=st.sampled_from([0, 1e-307, 5e-324, 0.5, 2]),
    min_p=st.sampled_from([0, 5e-324, 1e-300, 0.5, 1]),
    repetition_penalty=st.sampled_from([0.01, 0.5, 1, 10]),
    presence=st.sampled_from([-2, 0, 2]),
    frequency=st.sampled_from([-2, 0, 2]),
    bias=st.sampled_from([{}, {"0": 100}, {"1": -100, "3": 100}]),
    min_tokens=st.sampled_from([0, 3]),
    logprobs=st.sampled_from([None, 0, 5]),
    seed=st.integers(0, 2**64 - 1),
)
def test_any_accepted_parameters_sample_extreme_logits(
    temperature: float, min_p: float, repetition_penalty: float, presence: float,
    frequency: float, bias: dict[str, int], min_tokens: int, logprobs: int | None, seed: int,
) -> None:  # fmt: skip
    """Whatever values the parser accepts, float32 logits at the ends of
    their range are sampled (an id, finite logprobs), never a NaN or a raise."""
    request = parse_completion(
        {"model": "m", "prompt": "x", "temperature": temperature, "min_p": min_p,
         "repetition_penalty": repetition_penalty, "presence_penalty": presence,
         "frequency_penalty": frequency, "logit_bias": bias, "min_tokens": min_tokens,
         "logprobs": logprobs, "seed": seed, "stop_token_ids": [7]}
    )  # fmt: skip
    sampler = Sampler(request.options.sampling, request.options.seed)
    sampler.begin([0, 1, 7], eos_ids=[2])
    for _ in range(6):
        token = sampler(EXTREME)
        assert 0 <= token < EXTREME.size
        if logprobs is not None:
            assert sampler.last is not None and np.isfinite(sampler.last.logprob)
            assert all(np.isfinite(lp) for _, lp in sampler.last.top)


@pytest.mark.anyio
async def test_logprobs_of_a_real_model_chain_are_its_logits_log_softmax(model_dir: Path) -> None:
    """Two real model nodes (a tiny random Llama): each reported logprob is the
    float64 log-softmax of the logits one in-process runner computes."""
    from meshnet_model import StageRunner

    tokenizer = ModelTokenizer.load(model_dir)
    prompt_ids = tokenizer.encode("once upon a time")
    async with serve_openai(model_dir, stages=2) as served:
        client = client_for(served.url)
        result = await in_thread(
            client.completions.create, model="tiny-model", prompt="once upon a time",
            max_tokens=5, temperature=0, logprobs=5,
        )  # fmt: skip
    runner = StageRunner.load(model_dir)
    logits = runner.run("ref", 0, np.asarray([prompt_ids], dtype=np.int32))[0]
    position, reported = len(prompt_ids), result.choices[0].logprobs
    assert reported is not None and reported.token_logprobs is not None
    for k in range(5):
        row = reference_log_softmax(logits)
        token = int(np.argmax(logits))
        assert reported.token_logprobs[k] == pytest.approx(float(row[token]), **DRAWN_AT_LAST_STAGE)
        logits = runner.run("ref", position, np.asarray([[token]], dtype=np.int32))[0]
        position += 1
    runner.end_session("ref")

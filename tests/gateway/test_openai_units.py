"""The OpenAI surface's parts on their own: tokenizer and chat template,
sampling, stop sequences, request validation, the generation loop."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_gateway.openai.errors import OpenAIError
from meshnet_gateway.openai.generation import StopFilter, generate
from meshnet_gateway.openai.requests import parse_chat, parse_completion, parse_json_object
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import ChatTemplateError, ModelTokenizer, TextStream
from meshnet_model.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer.load(write_tokenizer(tmp_path_factory.mktemp("tok"), 300))


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_has_exactly_the_vocab_asked_and_every_id_decodes(
    tokenizer: ModelTokenizer,
) -> None:
    assert tokenizer.vocab_size == 300
    assert tokenizer.tokenizer.id_to_token(299) is not None
    assert isinstance(tokenizer.decode(list(range(300))), str)


def test_encode_prepends_bos_once_and_round_trips(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("hello wörld, the fox")
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1
    assert tokenizer.decode(ids) == "hello wörld, the fox"
    assert tokenizer.encode("<s>hi")[:2].count(tokenizer.bos_id) == 1  # not twice


def test_chat_template_renders_roles_special_tokens_and_the_generation_prompt(
    tokenizer: ModelTokenizer,
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.render_chat(messages)
    assert text == "<s><|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    assert not tokenizer.render_chat(messages, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    ids = tokenizer.encode(text, chat=True)
    # The markers are single special ids, not spelled out byte by byte.
    assert tokenizer.tokenizer.token_to_id("<|user|>") in ids
    assert ids.count(tokenizer.bos_id) == 1


def test_template_raise_exception_is_a_chat_template_error(tokenizer: ModelTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        tokenizer.render_chat([{"role": "robot", "content": "beep"}])


def test_template_tripping_over_the_messages_is_a_chat_template_error(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] + 5 }}"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ModelTokenizer.load(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_template_is_sandboxed_and_has_tojson(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ messages | tojson }}{{ ''.__class__.__mro__ }}"
    config_path.write_text(json.dumps(config))
    tok = ModelTokenizer.load(tmp_path)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses dunder access
        tok.render_chat([{"role": "user", "content": "é"}])
    config["chat_template"] = "{{ messages | tojson }}"
    config_path.write_text(json.dumps(config))
    rendered = ModelTokenizer.load(tmp_path).render_chat([{"role": "user", "content": "é"}])
    assert json.loads(rendered) == [{"role": "user", "content": "é"}] and "é" in rendered


def test_missing_template_falls_back_to_role_lines(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = ModelTokenizer.load(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "
    assert tok.eos_id is None and not tok.add_bos


def test_generation_config_eos_ids_also_stop(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 0}))
    tok = ModelTokenizer.load(tmp_path)
    assert tok.stop_ids == {1, 3, 4}  # </s>, config.json's and generation_config's


def test_post_processor_bos_is_not_doubled_and_chat_adds_none(tmp_path: Path) -> None:
    """A tokenizer whose post-processor adds bos (as Llama 3's does)."""
    from tokenizers import Tokenizer, processors

    write_tokenizer(tmp_path, 300)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = ModelTokenizer.load(tmp_path)
    assert tok.encode("hi")[:2].count(0) == 1 and tok.encode("hi")[0] == 0
    rendered = tok.render_chat([{"role": "user", "content": "hi"}])
    assert tok.encode(rendered, chat=True).count(0) == 1  # the template's own bos only


def test_template_can_print_the_date(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ strftime_now('%Y') }}"
    config_path.write_text(json.dumps(config))
    year = ModelTokenizer.load(tmp_path).render_chat([])
    assert year.isdigit() and len(year) == 4


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ModelTokenizer.load(tmp_path)


def test_text_stream_holds_back_half_a_character(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("é")[1:]  # byte-level: 'é' is two byte tokens here
    assert len(ids) == 2
    stream = TextStream(tokenizer)
    assert stream.push(ids[0]) == ""  # half of a UTF-8 sequence: nothing yet
    assert stream.push(ids[1]) == "é"
    assert stream.flush() == ""


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab é.\n", max_size=30))
def test_text_stream_pieces_join_to_the_decoded_text(text: str) -> None:
    tok = _shared_tokenizer()
    stream = TextStream(tok)
    ids = tok.encode(text)[1:]
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 299), max_size=40))
def test_text_stream_of_any_ids_joins_to_their_decoding(ids: list[int]) -> None:
    """Random ids (what a random model writes): broken UTF-8, special ids."""
    tok = _shared_tokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids)


_TOK: list[ModelTokenizer] = []


def _shared_tokenizer() -> ModelTokenizer:
    if not _TOK:
        import tempfile

        _TOK.append(ModelTokenizer.load(write_tokenizer(tempfile.mkdtemp(), 300)))
    return _TOK[0]


# ------------------------------------------------------------------ sampling

LOGITS = np.random.default_rng(3).standard_normal(300).astype(np.float32)


def draws(params: SamplingParams, seed: int | None, count: int = 50) -> list[int]:
    sampler = Sampler(params, seed)
    return [sampler(LOGITS) for _ in range(count)]


def test_temperature_zero_is_argmax_whatever_the_seed() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert draws(greedy, 1) == draws(greedy, 2) == [int(np.argmax(LOGITS))] * 50


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    params = SamplingParams(temperature=1.0)
    assert draws(params, 42) == draws(params, 42)
    assert draws(params, 42) != draws(params, 43)
    assert len(set(draws(params, 42))) > 5  # really sampling, not argmax


def test_top_k_keeps_only_the_k_best() -> None:
    best = set(np.argsort(-LOGITS)[:3].tolist())
    got = set(draws(SamplingParams(temperature=2.0, top_k=3), 0, 300))
    assert got == best
    assert set(draws(SamplingParams(temperature=2.0, top_k=1), 0)) == {int(np.argmax(LOGITS))}


def test_top_p_keeps_the_nucleus() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7), 0)
    assert {sampler(logits) for _ in range(300)} == {0, 1}  # 0.5 + 0.3 reaches 0.7
    tiny = Sampler(SamplingParams(temperature=1.0, top_p=0.01), 0)
    assert {tiny(logits) for _ in range(50)} == {0}


def test_non_finite_logits_are_never_chosen() -> None:
    logits = np.array([np.nan, 1.0, np.inf, -np.inf, 0.5])
    sampler = Sampler(SamplingParams(temperature=1.0), 0)
    assert {sampler(logits) for _ in range(100)} <= {1, 4}
    with pytest.raises(ValueError):
        sampler(np.array([np.nan, np.nan]))


def test_sampling_params_are_checked() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ stop sequences


def run_filter(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    flt = StopFilter(stops)
    out = ""
    for piece in pieces:
        text, stopped = flt.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + flt.flush(), False


def test_stop_split_across_pieces_never_leaks() -> None:
    assert run_filter(["END"], ["abc E", "N", "D more"]) == ("abc ", True)
    assert run_filter(["END"], ["abc E", "N", "x"]) == ("abc ENx", False)
    assert run_filter(["\n\n", "x"], ["a\n", "\nb"]) == ("a", True)
    # The first stop to complete wins, even if a longer one began earlier.
    assert run_filter(["c", "acc"], ["ac", "c"]) == ("a", True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="abc\n", max_size=4), max_size=10),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), max_size=3),
)
def test_stop_filter_equals_cutting_the_text_where_a_stop_first_appears(
    pieces: list[str], stops: list[str]
) -> None:
    # Generation ends at the first piece after which the text holds a stop
    # sequence (a longer one still in progress then does not count), and
    # the text is cut before the earliest stop it holds at that point.
    text, expected = "", None
    for piece in pieces:
        text += piece
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            expected = (text[: min(cuts)], True)
            break
    assert run_filter(stops, pieces) == (expected or (text, False))


# ------------------------------------------------------------------ requests


def error_of(fn, document: object) -> OpenAIError:  # type: ignore[no-untyped-def]
    with pytest.raises(OpenAIError) as caught:
        fn(document)
    assert 400 <= caught.value.status < 500
    return caught.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", 3),
        ("max_tokens", -1),
        ("max_tokens", "10"),
        ("max_tokens", True),
        ("temperature", "hot"),
        ("temperature", 2.5),
        ("top_p", -0.1),
        ("top_k", 1.5),
        ("seed", -4),
        ("stop", 5),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("n", 17),  # above MAX_CHOICES
        ("n", 0),
        ("stream", "yes"),
        ("logprobs", 6),
        ("logprobs", True),
        ("echo", True),
        ("presence_penalty", 2.5),
        ("frequency_penalty", "x"),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("prompt", {"text": "x"}),
        ("prompt", ["one", "two"]),
        ("prompt", []),
    ],
)
def test_completion_fields_are_validated(field: str, value: object) -> None:
    document = {"model": "m", "prompt": "hi", field: value}
    error = error_of(parse_completion, document)
    assert error.param == field and error.type == "invalid_request_error"


def test_completion_accepts_the_usual_fields() -> None:
    request = parse_completion(
        {"model": "m", "prompt": ["hi"], "max_tokens": 0, "temperature": 0, "top_p": 0.9,
         "top_k": 5, "seed": 7, "stop": "\n", "n": 1, "stream": True,
         "stream_options": {"include_usage": True}, "user": "u", "presence_penalty": 0}
    )  # fmt: skip
    options = request.options
    assert request.prompt == "hi" and options.max_tokens == 0 and options.seed == 7
    assert options.sampling == SamplingParams(temperature=0.0, top_p=0.9, top_k=5)
    assert options.stop == ("\n",) and options.stream and options.include_usage
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]


@pytest.mark.parametrize(
    "messages",
    [None, [], "hi", [3], [{"content": "x"}], [{"role": "user", "content": 4}],
     [{"role": "user", "content": [{"type": "image_url"}]}]],
)  # fmt: skip
def test_chat_messages_are_validated(messages: object) -> None:
    error = error_of(parse_chat, {"model": "m", "messages": messages})
    assert error.param is not None and error.param.startswith("messages")


def test_chat_text_parts_are_joined_and_max_completion_tokens_counts() -> None:
    request = parse_chat(
        {"model": "m", "max_completion_tokens": 9,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]}]}
    )  # fmt: skip
    assert request.messages == [{"role": "user", "content": "ab"}]
    assert request.options.max_tokens == 9


@pytest.mark.parametrize("body", [b"{", b"[1]", b"\xff\xfe", b"null"])
def test_body_must_be_a_json_object(body: bytes) -> None:
    error = error_of(parse_json_object, body)
    assert error.body()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ the generation loop


class ScriptedChain:
    """A chain whose logits make the sampler pick ``script`` in order."""

    def __init__(self, script: list[int], vocab: int = 300) -> None:
        self.script = script
        self.vocab = vocab
        self.sent: list[list[int]] = []

    def _logits(self) -> np.ndarray:
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[self.script[len(self.sent) - 1]] = 10.0
        return logits

    async def prefill(self, ids: list[int], sample: object = None) -> np.ndarray:
        """Logits whatever ``sample`` asks (a chain that ignores wire-2 §3.13)."""
        self.sent.append(list(ids))
        return self._logits()

    @contextlib.asynccontextmanager
    async def pipelined(self) -> AsyncIterator[None]:
        yield  # every answer here is immediate: nothing in flight

    async def step(self, token_id: int, sample: object = None) -> np.ndarray:
        self.sent.append([token_id])
        return self._logits()


@pytest.mark.anyio
async def test_generate_stops_at_eos_counts_it_and_steps_once_per_token(
    tokenizer: ModelTokenizer,
) -> None:
    words = tokenizer.encode("the fox")[1:]
    chain = ScriptedChain([*words, tokenizer.eos_id, 5])  # type: ignore[list-item]
    pieces: list[str] = []

    async def on_text(piece: str, logprobs: object) -> None:
        assert logprobs is None  # not asked for
        pieces.append(piece)

    greedy = Sampler(SamplingParams(temperature=0.0), None)
    result = await generate(chain, tokenizer, [0, 9], max_tokens=50, sampler=greedy,  # type: ignore[arg-type]
                            on_text=on_text)  # fmt: skip
    assert result.text == "".join(pieces) == "the fox"
    assert result.finish_reason == "stop"
    assert result.completion_tokens == len(words) + 1  # eos is generated, not shown
    assert chain.sent == [[0, 9], *[[w] for w in words]]  # no step after eos


@pytest.mark.anyio
async def test_generate_length_and_no_step_after_the_last_token(
    tokenizer: ModelTokenizer,
) -> None:
    words = tokenizer.encode("the quick brown fox")[1:]
    chain = ScriptedChain(words)
    greedy = Sampler(SamplingParams(temperature=0.0), None)
    result = await generate(chain, tokenizer, [0], max_tokens=3, sampler=greedy)  # type: ignore[arg-type]
    assert result.finish_reason == "length" and result.completion_tokens == 3
    assert result.text == tokenizer.decode(words[:3])
    assert len(chain.sent) == 3  # prefill + 2 steps: the 3rd token needs none
    nothing = await generate(ScriptedChain(words), tokenizer, [0], max_tokens=0, sampler=greedy)  # type: ignore[arg-type]
    assert nothing.completion_tokens == 0 and nothing.finish_reason == "length"


@pytest.mark.anyio
async def test_generate_cuts_at_a_stop_sequence(tokenizer: ModelTokenizer) -> None:
    words = tokenizer.encode("the quick brown fox jumps")[1:]
    greedy = Sampler(SamplingParams(temperature=0.0), None)
    result = await generate(ScriptedChain(words), tokenizer, [0], max_tokens=50,  # type: ignore[arg-type]
                            sampler=greedy, stop=["brown", "zzz"])  # fmt: skip
    assert result.text == "the quick " and result.finish_reason == "stop"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs", "echo",
          "presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs", "min_p",
          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "response_format",
          "best_of", "suffix", "tools"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8))
def test_any_json_document_is_parsed_or_refused_as_a_4xx(document: dict[str, object]) -> None:
    """Whatever a client sends, the parser answers a request or an OpenAIError (never a 500)."""
    for parse in (parse_completion, parse_chat):
        try:
            parse(document)
        except OpenAIError as exc:
            assert 400 <= exc.status < 500 and exc.message


# ------------------------------------------------------------------ flags


def test_gateway_model_flags_come_from_the_environment_too() -> None:
    from meshnet_gateway.config import GatewayConfig

    env = {"MESHNET_MODEL": "/models/x", "MESHNET_MAX_TOKENS_DEFAULT": "5",
           "MESHNET_MAX_CONTEXT": "0", "MESHNET_MODEL_NAME": "x"}  # fmt: skip
    config = GatewayConfig.load(["--entry", "http://127.0.0.1:1"], env)
    assert (config.model, config.model_name, config.max_tokens_default, config.max_context) == (
        "/models/x",
        "x",
        5,
        0,
    )
    flagged = GatewayConfig.load(["--entry", "http://127.0.0.1:1", "--max-context", "64"], env)
    assert flagged.max_context == 64  # a flag beats the environment
    with pytest.raises(SystemExit) as exited:
        GatewayConfig.load(["--entry", "http://127.0.0.1:1"], {"MESHNET_MAX_CONTEXT": "-1"})
    assert exited.value.code == 2

"""What a checkpoint directory says besides its weights: the chat template where
transformers 5 saves it, generation_config.json's defaults, and configs the
chain cannot run exactly — refused at the start of every entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnet_cli.__main__ import main as cli_main
from meshnet_gateway.__main__ import main as gateway_main
from meshnet_gateway.openai.defaults import GenerationDefaults
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import FALLBACK_TEMPLATE, ModelTokenizer
from meshnet_model.sampling import SamplingParams
from meshnet_node.__main__ import main as node_main
from support.openai import VOCAB, reference_greedy, serve_openai, write_model_dir
from support.openai_client import client_for, in_thread


def _set_config(directory: Path, **values: object) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(values)
    path.write_text(json.dumps(config))


def test_chat_template_jinja_wins_and_named_lists_use_default(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    _set_config(tmp_path, chat_template="config {{ messages[0]['content'] }}")
    hi = [{"role": "user", "content": "hi"}]
    assert ModelTokenizer.load(tmp_path).render_chat(hi) == "config hi"
    # transformers 5 saves the template as its own file; it takes priority there too.
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0]['content'] }}")
    assert ModelTokenizer.load(tmp_path).render_chat(hi) == "file hi"
    (tmp_path / "chat_template.jinja").unlink()
    _set_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ messages[0]['content'] }}"},
    ])  # fmt: skip
    assert ModelTokenizer.load(tmp_path).render_chat(hi) == "default hi"
    _set_config(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"}])
    assert ModelTokenizer.load(tmp_path).chat_template == FALLBACK_TEMPLATE


def test_generation_defaults_fill_only_what_the_request_left_out() -> None:
    api = SamplingParams()  # the API's own defaults: temperature 1, top_p 1, top_k 0
    sampled = GenerationDefaults.from_dict(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64}
    )
    assert sampled.sampling(api, frozenset()) == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20
    )
    given = SamplingParams(temperature=0.2, top_p=1.0, top_k=0)
    assert sampled.sampling(given, frozenset({"temperature", "top_k"})) == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=0
    )
    assert sampled.max_new_tokens == 64
    greedy = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6, "top_p": 0.9})
    assert greedy.sampling(api, frozenset()) == SamplingParams(temperature=0.0)
    # No do_sample in the file: its temperature is the default, as vLLM applies it.
    assert GenerationDefaults.from_dict({"temperature": 0.7}).sampling(api, frozenset()) == (
        SamplingParams(temperature=0.7)
    )
    assert GenerationDefaults.from_dict({}).sampling(api, frozenset()) is api
    for bad in ({"temperature": "hot"}, {"top_p": 3}, {"top_k": -1}, {"max_new_tokens": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GenerationDefaults.from_dict(bad)


@pytest.mark.anyio
async def test_generation_config_greedy_and_length_apply_to_a_bare_request(
    tmp_path: Path,
) -> None:
    model_dir = write_model_dir(tmp_path / "tiny-model")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.9, "max_new_tokens": 6})
    )
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "a b c d"
    async with serve_openai(model_dir, stages=2) as served:
        client = client_for(served.url)
        # No temperature, no max_tokens, no seed: greedy and 6 tokens, from the file.
        first = await in_thread(client.completions.create, model="tiny-model", prompt=prompt)
        again = await in_thread(client.completions.create, model="tiny-model", prompt=prompt)
    expected = reference_greedy(model_dir, tokenizer.encode(prompt), 6)
    assert first.usage is not None and first.usage.completion_tokens == 6
    assert first.choices[0].text == again.choices[0].text == tokenizer.decode(expected)


def test_a_refused_config_is_one_line_and_exit_2_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = write_model_dir(tmp_path / "m", vocab=VOCAB)
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_act": "gelu_new"}))
    runs = {
        "meshnet-node": lambda: node_main(["--port", "0", "--model", str(model_dir)]),
        "meshnet-gateway": lambda: gateway_main(
            ["--port", "0", "--entry", "http://127.0.0.1:1", "--model", str(model_dir)]
        ),
        "meshnet run": lambda: cli_main(["run", "--model", str(model_dir), "--port", "0"]),
    }
    for name, run in runs.items():
        assert run() == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"{name}: cannot load --model {model_dir}: "), err
        assert 'hidden_act="gelu_new" is not supported' in err and err.count("\n") == 1, err

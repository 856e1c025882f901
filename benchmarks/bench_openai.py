"""What the OpenAI surface costs: decoding through the gateway's /v1 API
against driving the same chain bare, side by side in one run.

    .venv/bin/python benchmarks/bench_openai.py [--stages 2] [--tokens 32] [--prompt 64]

One random Llama checkpoint (default: hidden 256, 8 layers, vocab 4096; a
tokenizer trained here), split over ``--stages`` loopback nodes in this
process, and a gateway with ``--model`` in front. The *bare* path is the node
contract itself (``ModelSession``: the prompt's ids in one run, then one
``[1, 1]`` run per token, greedy argmax here); the *api* path sends the same
prompt ids to ``POST /v1/completions`` with ``stream: true, temperature: 0``
from a plain HTTP client in a thread, so the nodes do the same work. Both
must produce the same text. Figures (best of ``--repeat``, alternating):
the whole request for 1 token (prefill + first token: time to first token,
tokenizing and HTTP included for the API) and the decode rate from the
difference between ``--tokens`` tokens and 1 (an event is only sent for a
token whose text is complete, so per-event times would not count tokens).
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from meshnet_gateway import open_gateway
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ModelSession, even_splits, start_model_chain
from meshnet_runtime.config import load_config
from meshnet_runtime.downstream import DownstreamPool


async def bare(
    pool: DownstreamPool, prompt: list[int], tokens: int
) -> tuple[float, float, list[int]]:
    """(time to first token, decode seconds for tokens-1 steps, ids)."""
    session = ModelSession(pool)
    start = time.perf_counter()
    logits = await session.run(np.asarray([prompt], dtype=np.int32))
    ids = [int(np.argmax(logits[0]))]
    first = time.perf_counter() - start
    for _ in range(tokens - 1):
        logits = await session.decode(ids[-1])
        ids.append(int(np.argmax(logits[0])))
    decode = time.perf_counter() - start - first
    await session.delete()
    return first, decode, ids


def api(url: str, model: str, prompt: list[int], tokens: int) -> tuple[float, str]:
    """(seconds for the whole streamed request, its text)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    text, usage = "", None
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            text += "".join(choice["text"] for choice in event["choices"])
    seconds = time.perf_counter() - start
    conn.close()
    assert usage is not None and usage["completion_tokens"] == tokens, usage
    return seconds, text


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-openai-"))
    config = small_config(hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                          num_hidden_layers=args.layers, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=args.hidden // 8,
                          vocab_size=args.vocab, max_position_embeddings=4096)  # fmt: skip
    write_checkpoint(root, config, seed=1)
    write_tokenizer(root, args.vocab)
    # No eos: both paths must generate every token asked for (a random model
    # would otherwise end the API's generation whenever it samples eos).
    config_path = root / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    del tokenizer_config["eos_token"]
    config_path.write_text(json.dumps(tokenizer_config))
    tokenizer = ModelTokenizer.load(root)
    prompt = [int(i) for i in np.random.default_rng(0).integers(5, args.vocab, args.prompt)]
    splits = even_splits(args.layers, args.stages)
    async with start_model_chain(root, splits, extra=["--log-level", "warning"]) as nodes:
        flags = ["--port", "0", "--log-level", "warning", "--entry", nodes[0].url,
                 "--model", str(root), "--chunk-tokens", "128"]  # fmt: skip
        async with open_gateway(load_config("gateway", flags)) as gateway:
            pool = DownstreamPool(nodes[0].url)
            await bare(pool, prompt[:4], 2)  # warm: connections open on both paths
            await anyio.to_thread.run_sync(api, gateway.url, root.name, prompt[:4], 2)
            best_bare = [float("inf"), float("inf")]  # first token, decode steps
            best_api = [float("inf"), float("inf")]
            for _ in range(args.repeat):
                first, decode, ids = await bare(pool, prompt, args.tokens)
                best_bare = [min(best_bare[0], first), min(best_bare[1], decode)]
                one, _ = await anyio.to_thread.run_sync(api, gateway.url, root.name, prompt, 1)
                whole, text = await anyio.to_thread.run_sync(
                    api, gateway.url, root.name, prompt, args.tokens
                )
                best_api = [min(best_api[0], one), min(best_api[1], whole - one)]
                assert text == tokenizer.decode(ids), "the API and the bare chain disagree"
            await pool.aclose()
    steps = args.tokens - 1
    print(f"{args.stages} nodes, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; prompt {args.prompt} tokens, {args.tokens} generated; "
          f"best of {args.repeat}")  # fmt: skip
    print(f"  bare chain : first token {best_bare[0] * 1000:7.1f} ms, "
          f"decode {steps / best_bare[1]:7.1f} tokens/s")  # fmt: skip
    print(f"  OpenAI API : first token {best_api[0] * 1000:7.1f} ms, "
          f"decode {steps / best_api[1]:7.1f} tokens/s")  # fmt: skip
    print(f"  api_over_bare_decode_rate {best_bare[1] / best_api[1]:.3f}  "
          f"api_over_bare_first_token_time {best_api[0] / best_bare[0]:.3f}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    anyio.run(main, parser.parse_args(), backend="trio")

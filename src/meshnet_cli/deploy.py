"""``meshnet deploy MODEL --memory 4GiB,4GiB,…``: Kubernetes manifests for a chain.

The same inputs as ``python -m meshnet_model plan --memory`` (the model's
headers and the machines' memories, one stage per machine), rendered by
``manifests.render`` as plain YAML ``kubectl apply -f`` takes: a StatefulSet,
headless Service and PodDisruptionBudget per stage, the gateway's Deployment
and Service. Each pod's memory request and limit come from its stage's
footprint. The chain's token is read from a Secret the operator creates; no
credential is written. docs/kubernetes.md walks through it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnet_runtime.config import model_path_problem, positive_int
from meshnet_runtime.memory import parse_bytes

from .manifests import DeploySpec, StageSpec, render

if TYPE_CHECKING:
    from .__main__ import _Commands

__all__ = ["add_parser", "main"]

# DNS-1035 labels: every object's name is NAME-stage-K or NAME-gateway, and a
# StatefulSet's name must leave room for its pods' revision-hash label (63).
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
# DNS-1123 subdomains: Secret and PersistentVolumeClaim names.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
ENGINES = ("numpy", "torch")
DTYPES = ("keep", "float32", "bfloat16", "float16")


def _name(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"expected a lowercase DNS label of at most 40 characters (a-z, 0-9, '-', "
            f"starting with a letter), got {text!r}"
        )
    return text


def _object_name(text: str) -> str:
    if not _SUBDOMAIN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a Kubernetes object name, got {text!r}")
    return text


def _memories(text: str) -> list[int]:
    return [parse_bytes(part) for part in text.split(",")]


def _port(text: str) -> int:
    port = positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, got {text!r}")
    return port


def _image(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected an image reference, got {text!r}")
    return text


def _host_name(text: str) -> str:
    if not _SUBDOMAIN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a DNS name, got {text!r}")
    return text


def _host_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected an absolute directory, got {text!r}")
    return text


def add_parser(commands: _Commands) -> None:
    deploy = commands.add_parser(
        "deploy",
        help="render Kubernetes manifests for a chain over machines of given memories",
        description="Plan the split of MODEL over one machine per --memory (as python -m "
        "meshnet_model plan --memory does) and write the Kubernetes objects that run it: "
        "per stage a StatefulSet, its headless Service and a PodDisruptionBudget; the "
        "gateway's Deployment and Service. Create the chain's token first: kubectl "
        "create secret generic NAME-token --from-literal=token=... (docs/kubernetes.md).",
    )
    deploy.add_argument("model", metavar="MODEL", help="the .gguf file (or checkpoint directory)")
    deploy.add_argument(
        "--memory",
        type=_memories,
        required=True,
        metavar="SIZE[,SIZE...]",
        help="memory a pod of each stage may have, one per stage, e.g. 4GiB,4GiB,4GiB",
    )
    deploy.add_argument("--engine", choices=ENGINES, default="numpy", help="[numpy]")
    deploy.add_argument(
        "--dtype", choices=DTYPES, default=None, help="[float32 for numpy, keep for torch]"
    )
    deploy.add_argument("--name", type=_name, default="meshnet", help="objects' prefix [meshnet]")
    deploy.add_argument("--image", type=_image, default="meshnet:latest", help="[meshnet:latest]")
    deploy.add_argument("--replicas", type=positive_int, default=1, help="per stage [1]")
    deploy.add_argument("--gateway-replicas", type=positive_int, default=1, help="[1]")
    deploy.add_argument(
        "--cpus", type=positive_int, default=2, help="CPU request and --threads per stage [2]"
    )
    deploy.add_argument("--port", type=_port, default=8080, help="every container's port [8080]")
    deploy.add_argument(
        "--gateway-memory", type=parse_bytes, default=512 * 1024**2, help="[512MiB]"
    )
    deploy.add_argument(
        "--gateway-host",
        type=_host_name,
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients reach the gateway by (a Service or Ingress of yours; "
        "repeatable): the gateway refuses a Host it does not know",
    )
    deploy.add_argument(
        "--token-secret", type=_object_name, default=None, help="the token's Secret [NAME-token]"
    )
    volume = deploy.add_mutually_exclusive_group()
    volume.add_argument(
        "--model-claim",
        type=_object_name,
        default=None,
        help="PersistentVolumeClaim holding MODEL's file, mounted read-only [NAME-model]",
    )
    volume.add_argument(
        "--model-host-path",
        type=_host_path,
        default=None,
        help="or a directory of every machine holding it (hostPath)",
    )
    deploy.add_argument(
        "--startup-seconds",
        type=positive_int,
        default=600,
        help="longest a stage's load may take before it is restarted [600]",
    )
    deploy.add_argument(
        "--out", default=None, metavar="DIR", help="write one file per stage and the gateway's"
    )


def main(args: argparse.Namespace) -> int:
    """Render, then write to ``--out`` or stdout; a refusal is one line, exit 2."""
    problem = model_path_problem(args.model)
    if problem is not None:
        return _refuse(problem)
    try:
        spec = build_spec(args)
    except ValueError as exc:  # MemoryShortfall, ConfigError and CheckpointError among them
        return _refuse(str(exc))
    files = {name: as_yaml(spec, docs) for name, docs in render(spec).items()}
    if args.out is None:
        sys.stdout.write("---\n".join(files.values()))
        return 0
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
    except OSError as exc:
        return _refuse(f"cannot write --out {args.out}: {exc.strerror or exc}")
    print(f"meshnet deploy: wrote {', '.join(files)} to {out}", file=sys.stderr)
    return 0


def _refuse(message: str) -> int:
    print(f"meshnet deploy: {message}", file=sys.stderr)
    return 2


def build_spec(args: argparse.Namespace) -> DeploySpec:
    """The plan for ``args.memory`` and the names, as ``manifests.render`` takes them."""
    from meshnet_model.engines.footprint import MARGIN, format_bytes
    from meshnet_model.identity import checkpoint_model_id
    from meshnet_model.plan import plan_stages

    dtype = args.dtype or ("float32" if args.engine == "numpy" else "keep")
    plan = plan_stages(
        args.model, len(args.memory), engine=args.engine, dtype=dtype, memories=args.memory
    )
    stages = []
    for entry in plan:
        fp: dict[str, Any] = entry["footprint"]  # type: ignore[assignment]
        machine = int(entry["memory"])  # type: ignore[call-overload]
        # The node's KV budget (auto) is what the limit leaves beside the
        # rest, less the same margin the plan kept: a limit of total/(1 -
        # margin) gives it back the budget the plan chose.
        memory = min(machine, math.ceil(int(fp["total"]) / (1 - MARGIN)))
        start, stop = fp["layers"]
        text = (
            f"weights {format_bytes(fp['weights'])} {fp['form']}, KV {format_bytes(fp['kv'])}, "
            f"scratch {format_bytes(fp['scratch'])}, runtime {format_bytes(fp['runtime'])}; "
            f"{fp['engine']} {fp['dtype']}"
        )
        stages.append(StageSpec((int(start), int(stop)), memory, text))
    return DeploySpec(
        name=args.name,
        image=args.image,
        model_file=Path(args.model).name,
        model_id=checkpoint_model_id(args.model),
        engine=args.engine,
        dtype=dtype,
        stages=tuple(stages),
        port=args.port,
        replicas=args.replicas,
        gateway_replicas=args.gateway_replicas,
        cpus=args.cpus,
        gateway_memory=args.gateway_memory,
        token_secret=args.token_secret or "",
        model_claim=args.model_claim or "",
        model_host_path=args.model_host_path or "",
        startup_seconds=args.startup_seconds,
        gateway_hosts=tuple(args.gateway_host),
    )


def as_yaml(spec: DeploySpec, documents: list[dict[str, Any]]) -> str:
    """One file's documents, after a comment saying what they are."""
    import yaml

    head = f"# meshnet deploy: {spec.name}, {spec.model_file} over {len(spec.stages)} stages\n"
    body = yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
    return head + body

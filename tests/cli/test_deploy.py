"""``meshnet deploy``: Kubernetes manifests rendered from a model's plan.

The real model over two machines and an 8B-shaped file over three machines
of 4 GiB: the rendered files pass ``kubernetes-validate --strict`` for the
oldest and newest Kubernetes versions it ships schemas of, and say what the
plan says (layers, memory, the chain of names). The 8B file is its header
alone, the tensors' bytes a hole (a sparse file): a plan reads no tensor.
The chain the manifests describe is run in tests/system/test_deploy_chain.py.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from meshnet_cli.__main__ import main
from meshnet_model.engines.footprint import MARGIN
from meshnet_model.plan import plan_stages
from meshnet_model.testing.gguf import metadata_writer
from meshnet_model.testing.random_gguf import LLAMA_3_2_1B, tensor_plan
from support.smollm2 import smollm2_gguf

GiB = 1024**3
# Llama 3.1 8B's shape.
LLAMA_8B: dict[str, Any] = {
    **LLAMA_3_2_1B,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "head_dim": 128,
    "tie_word_embeddings": False,
}


def header_only_gguf(path: Path, config: dict[str, Any]) -> Path:
    """A Q4_0 GGUF file of ``config``'s shape whose tensor data is a hole:
    the header as llama.cpp writes it, then the file extended to its full
    size without writing (4.5 GB for 8B, a few KiB on disk)."""
    import gguf

    writer, _, _, _ = metadata_writer(path, config, qtype="Q4_0")
    alignment, data = 32, 0
    for name, shape, std in tensor_plan(config):
        if len(shape) == 1 or std == 0.0:
            nbytes = math.prod(shape) * 4
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            rows, columns = shape
            nbytes = rows * columns // 32 * 18  # Q4_0: 32 values in 18 bytes
            writer.add_tensor_info(
                name,
                (rows, columns // 32 * 18),
                np.dtype(np.uint8),
                nbytes,
                raw_dtype=gguf.GGMLQuantizationType.Q4_0,
            )
        data += -(-nbytes // alignment) * alignment
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    header = path.stat().st_size
    with path.open("r+b") as file:
        file.truncate(-(-header // alignment) * alignment + data)
    return path


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real")
    assert main(["deploy", str(smollm2_gguf()), "--memory", "1GiB,1GiB", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the 8B-shaped file, its manifests over three machines of 4 GiB)."""
    model = header_only_gguf(tmp_path_factory.mktemp("model") / "llama-8b.gguf", LLAMA_8B)
    out = tmp_path_factory.mktemp("big")
    argv = ["deploy", str(model), "--memory", "4GiB,4GiB,4GiB", "--engine", "torch"]
    assert main([*argv, "--name", "llama8b", "--replicas", "2", "--out", str(out)]) == 0
    return model, out


def documents(out: Path) -> list[dict[str, Any]]:
    return [
        doc for path in sorted(out.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
    ]


def by_kind(out: Path, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents(out) if doc["kind"] == kind]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only  # type: ignore[no-any-return]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _versions() -> list[str]:
    from kubernetes_validate.utils import all_versions

    versions = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [versions[0], versions[-1]]


@pytest.mark.parametrize("which", ["real", "big"])
def test_the_manifests_pass_kubernetes_validate_strict_oldest_and_newest(
    which: str, request: pytest.FixtureRequest
) -> None:
    rendered = request.getfixturevalue(which)
    out = rendered if which == "real" else rendered[1]
    files = [str(path) for path in sorted(out.glob("*.yaml"))]
    count = len(documents(out))
    for version in _versions():
        argv = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *files]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count(" passed for resource ") == count, done.stdout


def test_each_stage_is_a_statefulset_behind_a_headless_service_named_by_the_next_hop(
    real: Path,
) -> None:
    assert sorted(path.name for path in real.glob("*.yaml")) == [
        "gateway.yaml",
        "stage-0.yaml",
        "stage-1.yaml",
    ]
    services = {doc["metadata"]["name"]: doc for doc in by_kind(real, "Service")}
    sets = by_kind(real, "StatefulSet")
    assert [s["metadata"]["name"] for s in sets] == ["meshnet-stage-0", "meshnet-stage-1"]
    for k, statefulset in enumerate(sets):
        name = statefulset["spec"]["serviceName"]
        assert services[name]["spec"]["clusterIP"] == "None"
        selector = statefulset["spec"]["selector"]["matchLabels"]
        assert services[name]["spec"]["selector"] == selector
        assert selector.items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
        args = container(statefulset)["args"]
        after = "http://meshnet-stage-1:8080" if k == 0 else None
        assert flag(args, "--next") == after
    gateway = container(by_kind(real, "Deployment")[0])
    assert flag(gateway["args"], "--entry") == "http://meshnet-stage-0:8080"
    assert services["meshnet-gateway"]["spec"].get("clusterIP") != "None"
    budgets = by_kind(real, "PodDisruptionBudget")
    assert [b["spec"]["maxUnavailable"] for b in budgets] == [1, 1]


def test_layers_and_memory_are_the_plans(real: Path) -> None:
    plan = plan_stages(smollm2_gguf(), 2, engine="numpy", dtype="float32", memories=[GiB, GiB])
    for stage, statefulset in zip(plan, by_kind(real, "StatefulSet"), strict=True):
        node = container(statefulset)
        assert flag(node["args"], "--layers") == stage["layers"]
        assert (flag(node["args"], "--engine"), flag(node["args"], "--dtype")) == (
            "numpy",
            "float32",
        )
        resources = node["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        limit = int(resources["limits"]["memory"].removesuffix("Mi")) * 1024**2
        total = stage["footprint"]["total"]  # type: ignore[index]
        # What the stage holds, with the margin the node's KV budget keeps free.
        assert total <= limit <= GiB
        assert limit >= min(GiB, total / (1 - MARGIN))


def test_probes_ask_what_the_servers_answer(real: Path) -> None:
    for workload in [*by_kind(real, "StatefulSet"), *by_kind(real, "Deployment")]:
        probes = container(workload)
        assert probes["startupProbe"]["httpGet"]["path"] == "/health"
        assert probes["readinessProbe"]["httpGet"]["path"] == "/health?ready=1"
        assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_token_comes_from_the_secret_and_the_model_from_a_read_only_volume(
    real: Path,
) -> None:
    for workload in [*by_kind(real, "StatefulSet"), *by_kind(real, "Deployment")]:
        one = container(workload)
        token = {
            "name": "MESHNET_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "meshnet-token", "key": "token"}},
        }
        assert token in one["env"]
        assert not any("token" in arg.lower() for arg in one["args"])
        mount = next(m for m in one["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        assert flag(one["args"], "--model") == f"/models/{smollm2_gguf().name}"
        pod = workload["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "meshnet-model", "readOnly": True}
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["enableServiceLinks"] is False
    assert by_kind(real, "Secret") == []  # the operator makes it: no credential written


def test_an_8b_shaped_file_over_three_machines_of_4gib(big: tuple[Path, Path]) -> None:
    model, out = big
    assert model.stat().st_blocks * 512 < 1024**2 < model.stat().st_size  # a hole, 4.5 GB
    sets = by_kind(out, "StatefulSet")
    assert [s["metadata"]["name"] for s in sets] == [f"llama8b-stage-{k}" for k in range(3)]
    spans = [flag(container(s)["args"], "--layers") for s in sets]
    bounds = [tuple(map(int, str(span).split(":"))) for span in spans]
    assert bounds[0][0] == 0 and bounds[-1][1] == 32
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    for statefulset in sets:
        assert statefulset["spec"]["replicas"] == 2
        node = container(statefulset)
        assert flag(node["args"], "--engine") == "torch"
        assert int(node["resources"]["limits"]["memory"].removesuffix("Mi")) <= 4096


def test_without_out_the_documents_go_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", str(smollm2_gguf()), "--memory", "1GiB,1GiB"]) == 0
    kinds = [doc["kind"] for doc in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds.count("StatefulSet") == 2 and kinds.count("Deployment") == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--memory", "64MiB,64MiB"], "no split of the 30 layers"),
        (["--memory", "1GiB,lots"], "expected bytes such as"),
        (["--memory", "1GiB", "--name", "Mesh_Net"], "a lowercase DNS label"),
        (["--memory", "1GiB", "--port", "70000"], "expected a port 1-65535"),
        (["--memory", "1GiB", "--model-host-path", "models"], "an absolute directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["deploy", str(smollm2_gguf()), *argv])
    except SystemExit as exc:  # argparse's refusal
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", str(tmp_path / "nothing.gguf"), "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshnet deploy: cannot load --model") and err.count("\n") == 1


def test_the_gateway_serves_its_service_names_and_the_ones_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["deploy", str(smollm2_gguf()), "--memory", "1GiB", "--gateway-host", "llm"]
    assert main([*argv, "--gateway-host", "llm.example.com"]) == 0
    (gateway,) = [
        d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Deployment"
    ]
    hosts = str(flag(container(gateway)["args"], "--allowed-hosts")).split(",")
    assert hosts[0] == "meshnet-gateway" and hosts[-2:] == ["llm", "llm.example.com"]
    assert "meshnet-gateway.$(POD_NAMESPACE).svc" in hosts  # the kubelet expands it

"""The chain ``meshnet deploy`` describes, run as its manifests describe it.

The real model's manifests over two machines of 1 GiB, each container's
command and arguments started as a process with the environment its
manifest gives it (the Secret's token injected), the Services' names
resolving to those processes, each pod on its own loopback address and its
manifest's port (``support.manifest_pods`` plays the cluster): the gateway
answers a greedy completion; a stage killed and started again under its
name, as its StatefulSet's controller does, and the answer is the same. The
probes are asked what the kubelet would ask along the way. And a stage whose
memory limit (a real cgroup) is below its footprint refuses to start with
one line and exit 2, before it could be killed for memory.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshnet_cli.__main__ import main
from support.manifest_pods import LocalCluster, Pod, quantity, run_limited
from support.smollm2 import smollm2_gguf
from support.waiting import wait_until_sync

pytestmark = pytest.mark.slow

TOKEN = "as-described-chain-token"
PROMPT = "The capital of France is"
# The file's greedy continuation, 8 tokens (the one transformers gives for
# it: tests/examples/test_real_model.py holds the two equal over 16 tokens).
ANSWER = " Paris.\n\nThe answer is:"
PROBE_WITHIN = 120.0  # seconds a probe's verdict has to change: a bound, not a speed


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("manifests")
    assert main(["deploy", str(smollm2_gguf()), "--memory", "1GiB,1GiB", "--out", str(out)]) == 0
    return [
        doc for path in sorted(out.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
    ]


def cluster_of(documents: list[dict[str, Any]], workdir: Path) -> LocalCluster:
    return LocalCluster(
        documents,
        secrets={"meshnet-token": {"token": TOKEN}},  # kubectl create secret generic ...
        volumes={"model": smollm2_gguf().parent},  # the claim's content
        workdir=workdir,
    )


def wait_probe(cluster: LocalCluster, pod: Pod, kind: str, want: int) -> None:
    """Until the pod's ``kind`` probe answers ``want`` (the kubelet asks every
    few seconds; here more often), bounded."""
    wait_until_sync(
        lambda: cluster.probe(pod, kind) == want,
        f"{pod.name}'s {kind} probe answering {want}",
        timeout=PROBE_WITHIN,
        every=0.2,
    )


def complete(cluster: LocalCluster) -> str:
    """A greedy completion from the gateway's Service, by its name."""
    document = {
        "model": smollm2_gguf().stem,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        cluster.service_url("meshnet-gateway") + "/v1/completions",
        json.dumps(document).encode(),
        {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {TOKEN}",
            "Host": "meshnet-gateway:8080",  # the Service's name: --allowed-hosts serves it
        },
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        text: str = json.loads(answer.read())["choices"][0]["text"]
    return text


def test_the_described_chain_answers_and_a_restarted_stage_rejoins_it(
    manifests: list[dict[str, Any]], tmp_path: Path
) -> None:
    cluster = cluster_of(manifests, tmp_path)
    assert [pod.name for pod in cluster.pods] == [
        "meshnet-gateway-0",
        "meshnet-stage-0-0",
        "meshnet-stage-1-0",
    ]
    gateway, first, last = cluster.pods
    try:
        for pod in cluster.pods:  # together, as Parallel pod management starts them
            cluster.start(pod)
        for pod in cluster.pods:
            cluster.wait_ready_line(pod)
            assert pod.url == f"http://{pod.ip}:8080"
            assert cluster.probe(pod, "startupProbe") == 200
        for pod in (gateway, first, last):
            wait_probe(cluster, pod, "readinessProbe", 200)
        answer = complete(cluster)
        assert answer == ANSWER

        cluster.kill(last)  # the last stage crashes
        wait_probe(cluster, gateway, "readinessProbe", 503)
        wait_probe(cluster, first, "readinessProbe", 503)
        assert cluster.probe(first, "livenessProbe") == 200  # not restarted for it

        cluster.start(last)  # its controller starts it again, the same pod
        cluster.wait_ready_line(last)
        for pod in (first, gateway):
            wait_probe(cluster, pod, "readinessProbe", 200)
        assert complete(cluster) == answer
    except BaseException:
        for pod in cluster.pods:
            print(f"--- {pod.name} stderr:\n{pod.stderr()[-3000:]}")
        raise
    finally:
        cluster.stop_all()


def test_a_stage_whose_memory_limit_is_below_its_footprint_refuses_in_one_line(
    manifests: list[dict[str, Any]], tmp_path: Path
) -> None:
    documents = copy.deepcopy(manifests)
    (stage,) = [
        d
        for d in documents
        if d["metadata"]["name"] == "meshnet-stage-0" and d["kind"] == "StatefulSet"
    ]
    resources = stage["spec"]["template"]["spec"]["containers"][0]["resources"]
    planned = quantity(resources["limits"]["memory"])
    # An operator's edit: a quarter of what the stage holds (its weights alone
    # are more), and still far above what the process needs to say so.
    resources["limits"]["memory"] = resources["requests"]["memory"] = f"{planned // 4 >> 20}Mi"
    cluster = cluster_of(documents, tmp_path)
    code, stderr = run_limited(cluster, cluster.pod("meshnet-stage-0-0"))
    assert code == 2, stderr  # not -9: an OOM kill
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"meshnet-node: layers 0:15 of {smollm2_gguf().name} need "), line
    assert f"may use {planned // 4 >> 20} MiB (cgroup memory" in line, line

"""Rendered Kubernetes manifests run as processes on this machine, as described.

``LocalCluster(documents, ...)`` plays the parts a cluster would, for the
objects ``meshnet deploy`` writes, and nothing else:

* the controllers: a StatefulSet's pods are ``NAME-0``, ``NAME-1``, … and a
  pod that dies is started again under its name with the same spec; a
  Deployment's pods are ``NAME-0``, …;
* the kubelet: a pod's one container is its ``command`` and ``args`` as a
  process (the command from this interpreter's ``bin``, as the image puts
  ``/opt/meshnet/bin`` on its PATH), its environment the container's
  ``env`` — values, ``secretKeyRef`` from the given secrets, ``fieldRef``
  — with ``$(VAR)`` expanded as the kubelet does; its volumes directories
  here (read-only mounts: the given host directories; ``emptyDir``: a fresh
  one per pod), paths under a mount rewritten to them; probes are GETs;
* the pod network: each pod its own loopback address (127.A.B.N, A and B
  drawn per cluster), so every pod listens on its manifest's port as in a
  cluster, and ``--host 0.0.0.0`` (in a pod, all of *its* addresses) is the
  pod's address;
* cluster DNS: a Service's name resolves to the addresses of the pods its
  selector matches (``pod_dns/sitecustomize.py``, on the pod's PYTHONPATH).

The pod's memory limit, when asked (``start(pod, cgroup=True)``), is a
memory cgroup of ``resources.limits.memory`` (``support.cgroup``).
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.cgroup import memory_cgroup

DNS_SHIM = Path(__file__).resolve().parent / "pod_dns"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "": 1}


def quantity(text: str) -> int:
    """A memory quantity as ``meshnet deploy`` writes them (``973Mi``), in bytes."""
    found = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|)", text)
    assert found is not None, text
    return int(found.group(1)) * _UNITS[found.group(2)]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)``: a defined variable's value, ``$$`` a ``$``,
    anything else left as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


@dataclass
class Pod:
    name: str
    ip: str
    labels: dict[str, str]
    container: dict[str, Any]
    volumes: dict[str, dict[str, Any]]
    process: subprocess.Popen[str] | None = None
    log: Path | None = None
    url: str = ""  # from its ready line
    restarts: int = 0
    scratch: dict[str, Path] = field(default_factory=dict)  # emptyDir volumes

    @property
    def port(self) -> int:
        return int(self.container["ports"][0]["containerPort"])

    def stderr(self) -> str:
        return self.log.read_text() if self.log is not None else ""


class LocalCluster:
    """The documents' pods and Services on this machine (module doc)."""

    def __init__(
        self,
        documents: list[dict[str, Any]],
        *,
        secrets: dict[str, dict[str, str]],
        volumes: dict[str, Path],
        workdir: Path,
        namespace: str = "default",
    ) -> None:
        self.secrets, self.volumes = secrets, volumes
        self.workdir, self.namespace = workdir, namespace
        self.services = [d for d in documents if d["kind"] == "Service"]
        prefix = f"127.{random.randrange(10, 250)}.{random.randrange(0, 250)}"
        self.pods: list[Pod] = []
        for doc in documents:
            if doc["kind"] not in ("StatefulSet", "Deployment"):
                continue
            template = doc["spec"]["template"]
            (container,) = template["spec"]["containers"]
            for ordinal in range(int(doc["spec"].get("replicas", 1))):
                pod = Pod(
                    name=f"{doc['metadata']['name']}-{ordinal}",
                    ip=f"{prefix}.{len(self.pods) + 2}",
                    labels=dict(template["metadata"]["labels"]),
                    container=container,
                    volumes={v["name"]: v for v in template["spec"]["volumes"]},
                )
                self.pods.append(pod)

    def pod(self, name: str) -> Pod:
        return next(pod for pod in self.pods if pod.name == name)

    def hosts(self) -> dict[str, list[str]]:
        """Each Service's name: its pods' addresses (what cluster DNS answers)."""
        found = {}
        for service in self.services:
            selector = service["spec"]["selector"].items()
            ips = [pod.ip for pod in self.pods if selector <= pod.labels.items()]
            found[service["metadata"]["name"]] = ips
        return found

    def service_url(self, name: str) -> str:
        """Where a client reaches a Service: one of its pods, on its port."""
        service = next(s for s in self.services if s["metadata"]["name"] == name)
        (ip, *_) = self.hosts()[name]
        return f"http://{ip}:{service['spec']['ports'][0]['port']}"

    # ------------------------------------------------------------------ the kubelet

    def _environment(self, pod: Pod) -> dict[str, str]:
        env: dict[str, str] = {}
        fields = {
            "metadata.namespace": self.namespace,
            "metadata.name": pod.name,
            "status.podIP": pod.ip,
        }
        for entry in pod.container.get("env", []):
            source = entry.get("valueFrom")
            if source is None:
                value = expand(str(entry.get("value", "")), env)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = self.secrets[ref["name"]][ref["key"]]
            else:
                value = fields[source["fieldRef"]["fieldPath"]]
            env[entry["name"]] = value
        return env

    def _mounts(self, pod: Pod) -> list[tuple[str, Path]]:
        """(mount path, directory here) of the pod's container, longest path first."""
        mounts = []
        for mount in pod.container.get("volumeMounts", []):
            volume = pod.volumes[mount["name"]]
            if "emptyDir" in volume:
                if mount["name"] not in pod.scratch:
                    directory = self.workdir / pod.name / mount["name"]
                    directory.mkdir(parents=True, exist_ok=True)
                    pod.scratch[mount["name"]] = directory
                mounts.append((mount["mountPath"], pod.scratch[mount["name"]]))
            else:
                assert mount.get("readOnly") is True, f"{mount['name']} is mounted writable"
                mounts.append((mount["mountPath"], self.volumes[mount["name"]]))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def argv(self, pod: Pod) -> tuple[list[str], dict[str, str]]:
        """The pod's process: its command and arguments, and its environment."""
        env = self._environment(pod)
        words = [expand(word, env) for word in [*pod.container["command"], *pod.container["args"]]]
        mounts = self._mounts(pod)
        for i, word in enumerate(words):
            for path, here in mounts:
                if word == path or word.startswith(path + "/"):
                    words[i] = str(here) + word[len(path) :]
                    break
            if word == "0.0.0.0" and i and words[i - 1] == "--host":
                words[i] = pod.ip  # the wildcard in a pod: the pod's own address
        executable = Path(sys.executable).parent / words[0]
        assert executable.is_file(), f"no {words[0]} beside {sys.executable}"
        words[0] = str(executable)
        base = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
        base.update(PYTHONPATH=str(DNS_SHIM), POD_DNS_HOSTS=json.dumps(self.hosts()))
        return words, {**base, **env}

    def start(self, pod: Pod, *, preexec: Any = None) -> None:
        """Start the pod's container (again, after a death: the same spec)."""
        argv, env = self.argv(pod)
        if pod.process is not None:
            pod.restarts += 1
        pod.log = self.workdir / f"{pod.name}.{pod.restarts}.log"
        with pod.log.open("w") as log:
            pod.process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, preexec_fn=preexec
            )

    def wait_ready_line(self, pod: Pod, timeout: float = 180.0) -> str:
        """The pod's ready line (the event its start is waited on), bounded."""
        assert pod.process is not None and pod.process.stdout is not None
        ready, _, _ = select.select([pod.process.stdout], [], [], timeout)
        line = pod.process.stdout.readline() if ready else ""
        assert " listening on " in line, f"{pod.name}: no ready line; stderr: {pod.stderr()}"
        pod.url = line.split(" listening on ", 1)[1].split()[0]
        return line

    def probe(self, pod: Pod, kind: str) -> int:
        """The kubelet's ``kind`` probe (``readinessProbe``, …): the status, 0 if none."""
        get = pod.container[kind]["httpGet"]
        url = f"http://{pod.ip}:{pod.port}{get['path']}"
        try:
            with urllib.request.urlopen(url, timeout=pod.container[kind]["timeoutSeconds"]) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def kill(self, pod: Pod) -> None:
        """A crash: SIGKILL, nothing drained."""
        assert pod.process is not None
        pod.process.kill()
        pod.process.wait()

    def stop_all(self) -> None:
        for pod in self.pods:
            if pod.process is not None and pod.process.poll() is None:
                pod.process.terminate()
        for pod in self.pods:
            if pod.process is not None:
                try:
                    pod.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pod.process.kill()
                    pod.process.wait()


def run_limited(cluster: LocalCluster, pod: Pod, timeout: float = 120.0) -> tuple[int, str]:
    """The pod's container in a memory cgroup of its ``limits.memory``, run
    to its end: (exit status, stderr)."""
    limit = quantity(pod.container["resources"]["limits"]["memory"])
    with ExitStack() as stack:
        _, _, join = stack.enter_context(memory_cgroup(limit))
        cluster.start(pod, preexec=join)
        assert pod.process is not None
        try:
            code = pod.process.wait(timeout)
        finally:
            if pod.process.poll() is None:
                pod.process.kill()
                pod.process.wait()
    return code, pod.stderr()

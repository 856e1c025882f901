"""Kubernetes objects for a chain, from its plan: what ``meshnet deploy`` writes.

``render(spec)`` returns, per file, the documents ``kubectl apply -f`` takes
(plain dicts; ``meshnet_cli.deploy`` writes them as YAML). For each stage: a
headless ``Service`` (its DNS name is the ``--next`` of the stage above, and
the gateway's ``--entry`` for the first), a ``StatefulSet`` of the stage's
replicas and a ``PodDisruptionBudget``; then the gateway's ``Service`` and
``Deployment``. docs/kubernetes.md says what each field is for; the reasons
that shape a field are in the comments here. Nothing here reads a file: the
plan and the names come in ``DeploySpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONTAINER_USER",
    "DeploySpec",
    "MODEL_MOUNT",
    "StageSpec",
    "TOKEN_KEY",
    "render",
    "stage_name",
]

Document = dict[str, Any]

MODEL_MOUNT = "/models"  # where the model's volume is mounted, read-only
TOKEN_KEY = "token"  # the key of the chain's token in its Secret
CONTAINER_USER = 10001  # deploy/Containerfile's user: runAsNonRoot checks a number
CACHE_MOUNT = "/home/meshnet/.cache"  # XDG_CACHE_HOME in the image: --weights-cache auto


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of the plan: its layers, the bytes its pod may hold, and
    the footprint those bytes come from (shown in an annotation)."""

    layers: tuple[int, int]
    memory: int  # bytes: the container's memory request and limit
    footprint: str


@dataclass(frozen=True, slots=True)
class DeploySpec:
    """Everything a rendering takes (``meshnet deploy``'s flags, resolved)."""

    name: str  # prefix of every object's name
    image: str
    model_file: str  # the model's file name inside the volume
    model_id: str  # the checkpoint's id (wire-2 §6.1), a label on every pod
    engine: str
    dtype: str
    stages: tuple[StageSpec, ...]
    port: int = 8080
    replicas: int = 1  # per stage
    gateway_replicas: int = 1
    cpus: int = 2  # per stage: its CPU request and --threads
    gateway_memory: int = 512 * 1024**2
    token_secret: str = ""  # default: <name>-token
    model_claim: str = ""  # a PersistentVolumeClaim (default: <name>-model) ...
    model_host_path: str = ""  # ... or a directory of the machine
    startup_seconds: int = 600  # the longest a model's load may take
    gateway_hosts: tuple[str, ...] = ()  # more names clients reach the gateway by

    @property
    def secret(self) -> str:
        return self.token_secret or f"{self.name}-token"

    @property
    def model_path(self) -> str:
        return f"{MODEL_MOUNT}/{self.model_file}"


def stage_name(spec: DeploySpec, k: int) -> str:
    return f"{spec.name}-stage-{k}"


def render(spec: DeploySpec) -> dict[str, list[Document]]:
    """The documents of each file: ``stage-K.yaml`` per stage, ``gateway.yaml``."""
    files = {f"stage-{k}.yaml": _stage(spec, k) for k in range(len(spec.stages))}
    files["gateway.yaml"] = _gateway(spec)
    return files


def _labels(spec: DeploySpec, component: str) -> dict[str, str]:
    """What selects one stage's (or the gateway's) pods: immutable in a
    StatefulSet's selector, so the model (which a new version changes) is
    not among them but beside them on the pods (``_pod_labels``)."""
    return {
        "app.kubernetes.io/name": "meshnet",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def _pod_labels(spec: DeploySpec, component: str) -> dict[str, str]:
    # `kubectl get pods -L meshnet/model` shows which checkpoint each pod
    # serves: during a rollout, whether a chain mixes two.
    return {**_labels(spec, component), "meshnet/model": spec.model_id}


def _meta(name: str, labels: dict[str, str]) -> Document:
    return {"name": name, "labels": {**labels, "app.kubernetes.io/managed-by": "meshnet-deploy"}}


def _stage(spec: DeploySpec, k: int) -> list[Document]:
    name, component = stage_name(spec, k), f"stage-{k}"
    labels = _labels(spec, component)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, labels),
        "spec": {
            # Headless: the name resolves to every replica's address, and the
            # hop above treats each address as a replica (docs/failover.md).
            "clusterIP": "None",
            # Every pod, ready or not: the hop above probes each replica
            # itself and pins what it serves, so a pod that restarts keeps
            # its place, and readiness (which follows the chain below) cannot
            # take a whole hop out of DNS and slow its return.
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, labels),
        "spec": {
            "serviceName": name,
            "replicas": spec.replicas,
            # Replicas of a stage are interchangeable: start them together,
            # not each after the one before is ready.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": labels},
            "template": _stage_pod(spec, k),
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, labels),
        # One replica at a time: a drain never empties a hop of several
        # replicas, and never blocks on a hop of one (minAvailable would).
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }
    return [service, statefulset, budget]


def _stage_pod(spec: DeploySpec, k: int) -> Document:
    stage = spec.stages[k]
    a, b = stage.layers
    # The engine the plan sized the stage for: the image's default could
    # differ (torch when it has torch).
    flags = {
        "--host": "0.0.0.0",
        "--port": str(spec.port),
        "--model": spec.model_path,
        "--layers": f"{a}:{b}",
        "--engine": spec.engine,
        "--dtype": spec.dtype,
        "--threads": str(spec.cpus),
    }
    if k + 1 < len(spec.stages):
        flags["--next"] = f"http://{stage_name(spec, k + 1)}:{spec.port}"
    container = _container(spec, "node", "meshnet-node", flags)
    container["resources"] = {
        # Request = limit: the pod is sized to what the stage holds, and the
        # node reads the limit (its cgroup) to size its KV cache (auto).
        "requests": {"cpu": str(spec.cpus), "memory": _mebibytes(stage.memory)},
        "limits": {"memory": _mebibytes(stage.memory)},
    }
    annotations = {
        "meshnet/layers": f"{a}:{b}",
        "meshnet/model-file": spec.model_file,
        "meshnet/footprint": stage.footprint,
    }
    return _pod(spec, f"stage-{k}", container, annotations)


def _gateway(spec: DeploySpec) -> list[Document]:
    name, labels = f"{spec.name}-gateway", _labels(spec, "gateway")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, labels),
        "spec": {
            "selector": labels,
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }
    # The names clients reach it by: the gateway refuses any other Host
    # (DNS rebinding, docs/security.md); $(POD_NAMESPACE) is the kubelet's.
    hosts = [name] + [
        f"{name}.$(POD_NAMESPACE){suffix}" for suffix in ("", ".svc", ".svc.cluster.local")
    ]
    hosts += spec.gateway_hosts
    flags = {
        "--host": "0.0.0.0",
        "--port": str(spec.port),
        "--entry": f"http://{stage_name(spec, 0)}:{spec.port}",
        "--model": spec.model_path,
        "--allowed-hosts": ",".join(hosts),
    }
    container = _container(spec, "gateway", "meshnet-gateway", flags)
    namespace = {"fieldRef": {"fieldPath": "metadata.namespace"}}
    container["env"].insert(0, {"name": "POD_NAMESPACE", "valueFrom": namespace})
    memory = _mebibytes(spec.gateway_memory)
    container["resources"] = {
        "requests": {"cpu": "500m", "memory": memory},
        "limits": {"memory": memory},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, labels),
        "spec": {
            "replicas": spec.gateway_replicas,
            "selector": {"matchLabels": labels},
            # A new gateway serves (its chain check passed) before an old one goes.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": _pod(spec, "gateway", container, {"meshnet/model-file": spec.model_file}),
        },
    }
    return [service, deployment]


def _container(spec: DeploySpec, name: str, command: str, flags: dict[str, str]) -> Document:
    token = {"secretKeyRef": {"name": spec.secret, "key": TOKEN_KEY}}
    args = [text for flag, value in flags.items() for text in (flag, value)]
    return {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [command],
        "args": args,
        # The chain's token from its Secret, never in the arguments (a
        # process's arguments are visible to every user of the machine).
        "env": [{"name": "MESHNET_TOKEN", "valueFrom": token}],
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        **_probes(spec),
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_MOUNT},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _probes(spec: DeploySpec) -> Document:
    """What each probe asks (docs/kubernetes.md, "The probes")."""
    period = 5

    def get(path: str) -> Document:
        return {"httpGet": {"path": path, "port": "http"}}

    return {
        # Any answer: a server listens only once its model is loaded and its
        # identity computed; until then the liveness probe waits.
        "startupProbe": {
            **get("/health"),
            "periodSeconds": period,
            "timeoutSeconds": 3,
            "failureThreshold": max(1, -(-spec.startup_seconds // period)),
        },
        # Can this hop serve now: the chain below it passes its check (a
        # gateway: its own last check passed). Gates rollouts and the
        # gateway's Service; a node's DNS name lists its pods regardless.
        "readinessProbe": {
            **get("/health?ready=1"),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        # The loop answers; not the chain (a hop below down is no reason to
        # restart this one). Generous: a busy CPU may answer late.
        "livenessProbe": {
            **get("/health"),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def _pod(spec: DeploySpec, component: str, container: Document, notes: dict[str, str]) -> Document:
    model: Document
    if spec.model_host_path:
        model = {"hostPath": {"path": spec.model_host_path, "type": "Directory"}}
    else:
        claim = spec.model_claim or f"{spec.name}-model"
        model = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return {
        "metadata": {"labels": _pod_labels(spec, component), "annotations": notes},
        "spec": {
            # No SERVICE_HOST/_PORT variables: a Service named "meshnet" would
            # set MESHNET_PORT=tcp://..., which the servers read as --port.
            "enableServiceLinks": False,
            # A drain: --shutdown-timeout (5 s) and --handoff-window (10 s) fit.
            "terminationGracePeriodSeconds": 30,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": CONTAINER_USER,
                "runAsGroup": 0,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            # Replicas of one stage on different machines, where there are enough.
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": _labels(spec, component)},
                            },
                        },
                    ]
                }
            },
            "containers": [container],
            "volumes": [
                {"name": "model", **model},
                {"name": "tmp", "emptyDir": {}},
                {"name": "cache", "emptyDir": {}},
            ],
        },
    }


def _mebibytes(n: int) -> str:
    """Bytes as Kubernetes quantity in whole MiB, rounded up."""
    return f"{-(-n // 1024**2)}Mi"

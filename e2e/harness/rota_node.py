"""rota on real nodes: the images built, the nodes started, rota deployed from its manifests,
engines deployed from its examples. What the node tests, the demo and later cluster tests
build on.

    images = build_rota_images()
    with RealNode(cluster, "gpu-node-1", images, bin_dir=...) as node:
        rota = RotaOnNodes(cluster, [node], deploy(api))
        rota.wait_ready()
        engines = rota.deploy_engines("demo")
        url = rota.gateway_url()          # the host reaches the gateway pod through a relay

The host cannot reach pod addresses (they live in the nodes' network namespaces);
:meth:`RotaOnNodes.url` gives a loopback URL relayed to any pod address and port.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.cluster.realnode import RealNode
from e2e.harness.deploy import (
    EXAMPLES,
    Applier,
    RotaDeployment,
    images_of,
    is_ready,
    read,
    read_manifests,
)
from e2e.harness.objects import create_namespace
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec
from e2e.harness.waiting import eventually
from e2e.images import PAUSE_IMAGE, BuiltImages, build_images

REPO = Path(__file__).resolve().parents[2]
GATEWAY_PORT = 8080
CONTROLLER_PORT = 8090
DRIVER_HTTP_PORT = 8081
INSPECTION_SOCKET = "/var/lib/kubelet/plugins/gpu.rota.dev/inspect/inspect.sock"
"""The driver's inspection gRPC socket inside a node (its DaemonSet's ROTA_INSPECT_DIR)."""


def exec_in(api: client.ApiClient, namespace: str, pod: str, argv: Sequence[str], *,
            container: str | None = None, timeout: float = 60.0) -> str:
    """Run ``argv`` in a pod's container through the API (``kubectl exec``); its stdout.

    Raises:
        RuntimeError: the command failed; the message carries its stderr.
    """
    from kubernetes.stream import stream

    kwargs: dict[str, Any] = {"container": container} if container else {}
    ws = stream(client.CoreV1Api(api).connect_get_namespaced_pod_exec, pod, namespace,
                command=list(argv), stderr=True, stdin=False, stdout=True, tty=False,
                _preload_content=False, _request_timeout=timeout, **kwargs)
    try:
        ws.run_forever(timeout=timeout)
        out, err = ws.read_stdout(), ws.read_stderr()
        code = ws.returncode
    finally:
        ws.close()
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} in {namespace}/{pod} exited {code}: {err[-2000:]}")
    return str(out)


def build_rota_images() -> BuiltImages:
    """rota's images under the names its manifests and examples use. The simulator's names
    are the examples' images that rota builds (under its own registry path) other than
    rota's own: an example may also run rota's image (an init container copying
    ``rota-engine-gate``) or a third party's (``vllm/vllm-openai``), and a name given to two
    images of the archive makes containerd fail every container of either."""
    rota = sorted(images_of(read_manifests()))
    owners = {name.rsplit("/", 1)[0] + "/" for name in rota}
    named = set().union(*(images_of(read(p)) for p in EXAMPLES.glob("*.yaml")))
    simulator = sorted(name for name in named - set(rota) if name.startswith(tuple(owners)))
    return build_images(REPO, rota_names=rota, simulator_names=simulator,
                        pause_name=PAUSE_IMAGE)


@dataclass
class EnginePod:
    """An engine of an example: its pod and claim."""

    namespace: str
    name: str
    claim: str
    model: str

    def pod(self, api: client.ApiClient) -> client.V1Pod:
        return client.CoreV1Api(api).read_namespaced_pod(self.name, self.namespace,
                                                         _request_timeout=10)


def engine_docs(name: str, *, model: str, resident: str, awake: str,
                example: Path = EXAMPLES / "two-models.yaml") -> list[dict[str, Any]]:
    """A claim and an engine pod like the example's first, under another name and budgets."""
    docs = read(example)
    claim = copy.deepcopy(next(d for d in docs if d["kind"] == "ResourceClaim"))
    pod = copy.deepcopy(next(d for d in docs if d["kind"] == "Pod"))
    claim["metadata"]["name"] = name
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = \
        resident
    params = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    params.update({"model": model, "awakeMemory": awake})
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"]["app"] = name
    pod["spec"]["resourceClaims"][0]["resourceClaimName"] = name
    return [claim, pod]


QUICK_ENGINE_ARGS = ("--first-sleep-seconds", "0.3", "--later-sleep-seconds", "0.05",
                     "--wake-level1-seconds", "0.1", "--ttft-seconds", "0.02",
                     "--tokens-per-second", "120")
"""The engine simulator's timings for tests: quick sleeps and wakes."""


def gated_engine_docs(name: str, *, model: str, resident: str, awake: str,
                      sleep_level: int = 1, args: Sequence[str] = ()
                      ) -> list[dict[str, Any]]:
    """:func:`engine_docs` for an engine started through rota's start gate, with quick
    timings (``args``: more simulator arguments, which win over them), Ready only once
    the simulator itself answers (the gate holds its start)."""
    claim, pod = engine_docs(name, model=model, resident=resident, awake=awake)
    claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sleepLevel"] = sleep_level
    container = pod["spec"]["containers"][0]
    container["command"] = ["rota-engine-gate", "--", "python", "-m", "e2e.engine_simulator"]
    container["args"] = [*QUICK_ENGINE_ARGS, *args]
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8000},
                                   "periodSeconds": 1, "failureThreshold": 1}
    return [claim, pod]


def _pinned(docs: Sequence[Mapping[str, Any]], node: str) -> list[dict[str, Any]]:
    """Pods of an example pinned to ``node`` (the cluster may have other nodes)."""
    out: list[dict[str, Any]] = []
    for doc in docs:
        copied = copy.deepcopy(dict(doc))
        if copied["kind"] == "Pod":
            copied["spec"].setdefault("nodeSelector", {})["kubernetes.io/hostname"] = node
        out.append(copied)
    return out


def _model_of(claim: Mapping[str, Any]) -> str:
    for entry in claim["spec"]["devices"].get("config", []):
        params = entry.get("opaque", {}).get("parameters", {})
        if params.get("model"):
            return str(params["model"])
    return ""


@dataclass
class RotaOnNodes:
    """rota deployed on a cluster's real nodes."""

    cluster: LocalCluster
    nodes: list[RealNode]
    deployment: RotaDeployment
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = self.deployment.api

    def node(self, name: str | None = None) -> RealNode:
        if name is None:
            return self.nodes[0]
        return next(n for n in self.nodes if n.name == name)

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.deployment.wait_ready([n.name for n in self.nodes], timeout=timeout)

    def url(self, pod_ip: str, port: int) -> str:
        """A host URL relayed to ``pod_ip:port`` (found on the node that owns the pod)."""
        for node in self.nodes:
            if pod_ip.startswith(node.pod_cidr.rsplit(".", 1)[0] + "."):
                return node.forward(pod_ip, port)
        raise LookupError(f"no node of this cluster has pod address {pod_ip}")

    def pod_url(self, pod: client.V1Pod, port: int) -> str:
        return self.url(str(pod.status.pod_ip), port)

    def gateway_url(self) -> str:
        """A host URL of one Ready gateway replica."""
        return self.gateway_urls()[0]

    def gateway_urls(self) -> list[str]:
        """A host URL for each gateway replica an EndpointSlice would name: Ready and not
        being deleted."""
        pods = [p for p in self.deployment.gateway_pods()
                if is_ready(p) and p.metadata.deletion_timestamp is None]
        if not pods:
            raise LookupError("no gateway pod is Ready")
        return [self.pod_url(p, GATEWAY_PORT) for p in pods]

    def inspection_socket(self, node: str | None = None) -> Path:
        """The host path of a node's driver inspection socket (``NodeInspection``: the
        GPU's memory and processes as the driver reads them from NVML)."""
        return self.node(node).socket(INSPECTION_SOCKET)

    def controller_url(self, node: str | None = None) -> str:
        return self.pod_url(self.controller_pod(node), CONTROLLER_PORT)

    def _one(self, component: str, node: str | None) -> client.V1Pod:
        name = self.node(node).name
        pods = [p for p in self.deployment.pods(component, name) if is_ready(p)]
        if len(pods) != 1:
            raise LookupError(f"{len(pods)} Ready rota {component} pods on {name}")
        return pods[0]

    def driver_pod(self, node: str | None = None) -> client.V1Pod:
        """The Ready driver pod of a node."""
        return self._one("driver", node)

    def controller_pod(self, node: str | None = None) -> client.V1Pod:
        """The Ready lease controller pod of a node."""
        return self._one("controller", node)

    def logs(self, pod: client.V1Pod, container: str) -> str:
        """``kubectl logs`` (through the apiserver and the kubelet)."""
        return str(client.CoreV1Api(self.api).read_namespaced_pod_log(
            pod.metadata.name, pod.metadata.namespace, container=container,
            _request_timeout=30))

    def deploy_engines(self, namespace: str, *, node: str | None = None,
                       example: Path = EXAMPLES / "two-models.yaml",
                       docs: Sequence[Mapping[str, Any]] | None = None,
                       timeout: float = 180.0, wait: bool = True) -> list[EnginePod]:
        """Apply an example's claims and engine pods (or ``docs``) in ``namespace``
        (created when missing), pinned to a node; wait until every pod is Ready."""
        target = self.node(node).name
        create_namespace(self.api, namespace)
        docs = _pinned(docs if docs is not None else read(example), target)
        Applier(self.api).apply(docs, namespace)
        claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaim"}
        engines = []
        for doc in docs:
            if doc["kind"] != "Pod":
                continue
            claim = next(c.get("resourceClaimName", "") for c in doc["spec"]["resourceClaims"])
            engines.append(EnginePod(namespace, doc["metadata"]["name"], claim,
                                     _model_of(claims[claim]) if claim in claims else ""))
        for engine in engines if wait else []:
            eventually(lambda e=engine: is_ready(e.pod(self.api)),  # type: ignore[misc]
                       timeout=timeout, max_interval=2.0, what=f"engine {engine.name} Ready")
        return engines


@dataclass
class WatchedEngines:
    """Engine pods Ready on a real node, with the GPU sampled since before they started."""

    engines: dict[str, Engine]
    monitor: AwakeMonitor
    urls: dict[str, str]
    """Host URLs of the engines' own port, by name."""


def _ready_pod(api: client.ApiClient, namespace: str, name: str) -> client.V1Pod | None:
    pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _request_timeout=10)
    return pod if is_ready(pod) else None


@contextlib.contextmanager
def watched_engines(rota: RotaOnNodes, namespace: str,
                    docs: Mapping[str, Sequence[dict[str, Any]]],
                    specs: Mapping[str, EngineSpec], *, timeout: float = 300.0
                    ) -> Iterator[WatchedEngines]:
    """Apply each engine's claim (``docs``: [claim, pod] by name, ``specs`` the same
    names), start an :class:`AwakeMonitor` on the node's GPU, then apply the pods and wait
    until every one is Ready; the monitor stops when the block ends."""
    engines: dict[str, Engine] = {}
    for name, (claim, _) in docs.items():
        rota.deploy_engines(namespace, docs=[claim], wait=False)
        uid = client.ResourceV1Api(rota.api).read_namespaced_resource_claim(
            name, namespace, _request_timeout=10).metadata.uid
        engines[name] = Engine(specs[name], namespace, claim_uid=uid)
    with AwakeMonitor(rota.inspection_socket(), list(engines.values()),
                      interval_s=0.02) as monitor:
        for _, pod in docs.values():
            rota.deploy_engines(namespace, docs=[pod], wait=False)
        urls: dict[str, str] = {}
        for name, engine in engines.items():
            ready = eventually(functools.partial(_ready_pod, rota.api, namespace, name),
                               timeout=timeout, max_interval=2.0,
                               what=f"engine {name} admitted and Ready")
            assert ready is not None  # eventually returns a true value
            engine.pod_ip = str(ready.status.pod_ip)
            urls[name] = rota.url(engine.pod_ip, 8000)
        yield WatchedEngines(engines, monitor, urls)


def client_with_token(cluster: LocalCluster, token: str) -> client.ApiClient:
    """An API client that authenticates with a bearer token (a pod's, say)."""
    configuration = client.Configuration()
    configuration.host = cluster.server
    configuration.ssl_ca_cert = str(cluster.pki.ca_cert)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)

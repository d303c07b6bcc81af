"""Two claims share the fake H200 on the real node: the real scheduler allocates them, the
kubelet prepares them through rota's driver, containerd applies the CDI specs to real
containers, and deleting a pod makes the kubelet unprepare its claim."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import grpc
import pytest
from kubernetes import client

from e2e.cluster.realnode import RealNode
from e2e.harness.objects import read_claim
from e2e.harness.rota_node import EnginePod, RotaOnNodes, exec_in
from e2e.harness.waiting import eventually, eventually_async
from rota.kit.grpc_services import unary_client
from rota.pb.rota.v1 import inspect_pb2 as inspect
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]

GIB = 1024**3
PLUGIN = "/var/lib/kubelet/plugins/gpu.rota.dev"
LOOK = """
import json, os, stat
dev = {}
for name in sorted(os.listdir("/dev")):
    if name.startswith("nvidia"):
        st = os.stat("/dev/" + name)
        dev[name] = [stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)]
registry = os.environ.get("ROTA_FAKE_NVML_PROC_DIR", "")
print(json.dumps({"env": dict(os.environ), "dev": dev,
                  "registry": sorted(os.listdir(registry)) if registry else None}))
"""


def ledger(node: RealNode) -> dict[str, Any]:
    path = node.path(f"{PLUGIN}/ledger.json")
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text())["data"]["claims"])


def cdi_specs(node: RealNode) -> dict[str, dict[str, Any]]:
    return {p.stem.split("_", 1)[1]: json.loads(p.read_text())
            for p in node.path("/var/run/cdi").glob("k8s.gpu.rota.dev-claim_*.json")}


async def inspect_gpus(node: RealNode) -> inspect.InspectGpusResponse:
    socket = node.socket(f"{PLUGIN}/inspect/inspect.sock")
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        service = inspect.DESCRIPTOR.services_by_name["NodeInspection"]
        answer = await unary_client(channel, service, "InspectGpus")(
            inspect.InspectGpusRequest(), timeout=10)
    assert isinstance(answer, inspect.InspectGpusResponse)
    return answer


async def test_two_claims_share_the_gpu_in_real_containers(
        kube_api: client.ApiClient, rota_node: RotaOnNodes, namespace: str) -> None:
    node = rota_node.node()
    engines = rota_node.deploy_engines(namespace)
    by_name: dict[str, EnginePod] = {e.name: e for e in engines}
    claims = {e.name: read_claim(kube_api, namespace, e.claim) for e in engines}
    results = {n: c["status"]["allocation"]["devices"]["results"][0] for n, c in claims.items()}
    assert {r["device"] for r in results.values()} == {"gpu-0"}
    assert results["model-a"]["shareID"] != results["model-b"]["shareID"]
    uids = {n: c["metadata"]["uid"] for n, c in claims.items()}
    assert set(ledger(node)) >= set(uids.values())
    assert set(cdi_specs(node)) >= set(uids.values())

    # Inside each container: what the CDI spec gave it, and nothing it lacks.
    for name, engine in by_name.items():
        seen = json.loads(exec_in(kube_api, namespace, engine.name, ["python", "-c", LOOK]))
        env = seen["env"]
        assert env["ROTA_CLAIM_UID"] == uids[name]
        assert env["ROTA_MODEL"] == engine.model
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        assert env["ROTA_ENGINE_PORT"] == "8000"
        assert seen["dev"] == {"nvidia0": [True, 195, 0], "nvidiactl": [True, 195, 255],
                               "nvidia-uvm": [True, 510, 0]}
        assert seen["registry"] is not None  # the fake NVML registry, mounted by CDI
    awake = {"model-a": 60 * GIB, "model-b": 20 * GIB}
    assert json.loads(exec_in(kube_api, namespace, "model-a", ["python", "-c", LOOK])
                      )["env"]["ROTA_AWAKE_MEMORY_BYTES"] == str(awake["model-a"])

    # Each engine serves its model on its pod address, configured only through CDI.
    for name, engine in by_name.items():
        url = rota_node.pod_url(engine.pod(kube_api), 8000)
        async with aiohttp.ClientSession() as session, session.get(
                f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            assert (await resp.json())["data"][0]["id"] == engine.model, name

    # The driver attributes each engine's GPU memory to its pod and claim, by the host
    # pid NVML reports and the container's real cgroup.
    pods = {n: e.pod(kube_api).metadata.uid for n, e in by_name.items()}
    expected = {uids[n]: pods[n] for n in by_name}

    async def attributed() -> inspect.GpuState | None:
        (gpu,) = (await inspect_gpus(node)).gpus
        # Each engine registers its memory once it has started (seconds on a busy node).
        return gpu if {p.claim_uid: p.pod_uid for p in gpu.processes} == expected else None

    gpu = await eventually_async(attributed, timeout=120, what="both engines attributed")
    assert gpu is not None
    assert all(p.container_id for p in gpu.processes)

    # Deleting a pod makes the kubelet unprepare its claim.
    client.CoreV1Api(kube_api).delete_namespaced_pod("model-b", namespace,
                                                     grace_period_seconds=1)
    eventually(lambda: uids["model-b"] not in ledger(node)
               and uids["model-b"] not in cdi_specs(node),
               timeout=120, what="claim model-b unprepared")
    assert uids["model-a"] in ledger(node)

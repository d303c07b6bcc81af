"""End to end on the local cluster: the real scheduler allocates two claims on the fake
H200, the node agent prepares them over the driver's socket, starts two simulated engines
with the CDI environment, and unprepares when the pods go."""

from __future__ import annotations

import functools

import aiohttp
import grpc
import pytest
from kubernetes import client

from driver.pb.rota.v1 import inspect_pb2 as inspect
from driver.rpc.services import unary_client
from e2e.harness import GpuNode
from e2e.objects import claim, create_claim, engine_config, engine_pod, read_claim
from e2e.waiting import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

GIB = 1024**3


def _running(core: client.CoreV1Api, namespace: str, name: str) -> str:
    pod = core.read_namespaced_pod(name, namespace)
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    return str(pod.status.pod_ip) if pod.status.phase == "Running" and ready else ""


async def test_two_engines_share_the_gpu_through_the_whole_path(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    gpu_node.start_agent()
    core = client.CoreV1Api(kube_api)
    for name, model, resident, awake in (("a", "org/model-a", "2Gi", "60Gi"),
                                         ("b", "org/model-b", "1Gi", "20Gi")):
        create_claim(kube_api, namespace, claim(name, memory=resident,
                                                config=engine_config(model=model, awake=awake)))
        core.create_namespaced_pod(namespace, engine_pod(f"engine-{name}", node=gpu_node.name,
                                                         claim_name=name))
    ips = {name: eventually(functools.partial(_running, core, namespace, f"engine-{name}"),
                            timeout=60, what=f"engine-{name} running")
           for name in ("a", "b")}
    assert ips["a"] != ips["b"]

    uids = {n: read_claim(kube_api, namespace, n)["metadata"]["uid"] for n in ("a", "b")}
    specs = gpu_node.cdi_specs()
    assert set(specs) == set(uids.values())
    env_a = dict(e.split("=", 1) for e in specs[uids["a"]]["devices"][0]
                 ["containerEdits"]["env"])
    assert env_a["ROTA_AWAKE_MEMORY_BYTES"] == str(60 * GIB)
    assert env_a["ROTA_RESIDENT_MEMORY_BYTES"] == str(2 * GIB)
    assert env_a["ROTA_MODEL"] == "org/model-a"
    assert env_a["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")

    # Each engine serves its model on its own pod IP, configured only through CDI.
    async with aiohttp.ClientSession() as session, session.get(
            f"http://{ips['b']}:8000/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        assert (await resp.json())["data"][0]["id"] == "org/model-b"

    # The inspection API sees both processes and attributes them to their claims.
    async with grpc.aio.insecure_channel(f"unix://{gpu_node.dirs.inspect_socket}") as channel:
        service = inspect.DESCRIPTOR.services_by_name["NodeInspection"]
        state = await unary_client(channel, service, "InspectGpus")(
            inspect.InspectGpusRequest(), timeout=10)
    (gpu,) = state.gpus
    by_claim = {p.claim_uid: p for p in gpu.processes}
    assert set(by_claim) == set(uids.values())
    assert by_claim[uids["a"]].used_bytes == 60 * GIB
    assert gpu.used_bytes >= 80 * GIB

    for name in ("a", "b"):
        core.delete_namespaced_pod(f"engine-{name}", namespace)
    eventually(lambda: gpu_node.cdi_specs() == {} and gpu_node.ledger() == {}, timeout=60,
               what="claims unprepared after the pods are gone")

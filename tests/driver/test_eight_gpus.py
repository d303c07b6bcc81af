"""The eight-GPU fake node (``driver/nvml/fixtures/h200x8.json``): the driver publishes one
device per GPU, and a claim for several of them (a tensor-parallel engine), allocated by the
real scheduler, is prepared with a CDI spec that names every one of its GPUs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest
from kubernetes import client

from driver.nvml import fixture_path
from driver.nvml.fake import load_fixture
from e2e.cluster import LocalCluster
from e2e.engine_simulator.settings import settings_from_args
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import (
    DRIVER,
    claim,
    create_claim,
    engine_config,
    engine_pod,
    node_slices,
    read_claim,
)
from e2e.harness.waiting import eventually
from rota.pb.dra.v1 import api_pb2

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
GIB = 2**30
UUIDS = [gpu.uuid for gpu in load_fixture(fixture_path("h200x8")).devices]


@pytest.fixture
def eight_gpu_node(cluster: LocalCluster, kube_api: client.ApiClient, device_class: str
                   ) -> Iterator[GpuNode]:
    node = GpuNode(cluster=cluster, api=kube_api, name=f"gpu8-{uuid.uuid4().hex[:8]}",
                   fixture="h200x8")
    try:
        node.start_driver()
        yield node
    finally:
        node.close()


def tensor_parallel_claim(name: str, gpus: int, *, memory: str = "4Gi",
                          awake: str = "60Gi") -> dict[str, Any]:
    """A claim on ``gpus`` distinct GPUs of rota's device class. Each of rota's shared
    devices may be allocated many times; the 1.37 scheduler gave a request of count 2
    two distinct devices without a constraint too, but ``distinctAttribute`` on the GPU's
    uuid says what the claim needs (a repeated device would be refused at prepare,
    ``duplicate_device``)."""
    body = claim(name, memory=memory, config=engine_config(model=name, awake=awake))
    devices = body["spec"]["devices"]
    devices["requests"][0]["exactly"] |= {"allocationMode": "ExactCount", "count": gpus}
    devices["constraints"] = [{"requests": ["gpu"], "distinctAttribute": f"{DRIVER}/uuid"}]
    return body


def test_the_driver_publishes_eight_devices(eight_gpu_node: GpuNode,
                                            kube_api: client.ApiClient) -> None:
    def published() -> list[dict[str, Any]] | None:
        devices = [d for s in node_slices(kube_api, eight_gpu_node.name)
                   for d in s["spec"]["devices"]]
        return devices if len(devices) == 8 else None

    devices = eventually(published, timeout=30, what="eight devices published")
    assert devices is not None
    assert [d["name"] for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert [d["attributes"]["uuid"]["string"] for d in devices] == UUIDS
    assert [d["attributes"]["index"]["int"] for d in devices] == list(range(8))
    assert all(d["allowMultipleAllocations"] for d in devices)


def _prepare(socket: str, method: str, claims: Sequence[dict[str, Any]],
             request_cls: Any, response_cls: Any) -> Any:
    request = request_cls(claims=[api_pb2.Claim(
        namespace=c["metadata"]["namespace"], uid=c["metadata"]["uid"],
        name=c["metadata"]["name"]) for c in claims])
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_cls.FromString)
        return stub(request, timeout=30)


def _env(spec: dict[str, Any], device: int = 0) -> dict[str, str]:
    entries = spec["devices"][device]["containerEdits"]["env"]
    return dict(e.split("=", 1) for e in entries)


def test_claims_on_two_and_four_gpus_are_prepared_with_every_gpu(
        eight_gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    for name, gpus in (("tp2", 2), ("tp4", 4)):
        create_claim(kube_api, namespace, tensor_parallel_claim(name, gpus))
        core.create_namespaced_pod(namespace, engine_pod(name, node=eight_gpu_node.name,
                                                         claim_name=name))

    def allocated() -> list[dict[str, Any]] | None:
        found = [read_claim(kube_api, namespace, n) for n in ("tp2", "tp4")]
        return found if all(c.get("status", {}).get("allocation") for c in found) else None

    claims = eventually(allocated, timeout=60, what="the scheduler allocating both claims")
    assert claims is not None
    response = _prepare(str(eight_gpu_node.dirs.dra_socket), PREPARE, claims,
                        api_pb2.NodePrepareResourcesRequest,
                        api_pb2.NodePrepareResourcesResponse)
    specs = eight_gpu_node.cdi_specs()
    for body, gpus in zip(claims, (2, 4), strict=True):
        uid = body["metadata"]["uid"]
        results = body["status"]["allocation"]["devices"]["results"]
        names = [r["device"] for r in results]
        assert len(set(names)) == gpus, f"{body['metadata']['name']} got {names}"
        entry = response.claims[uid]
        assert entry.error == ""
        assert sorted(d.device_name for d in entry.devices) == sorted(names)
        spec = specs[uid]
        assert len(spec["devices"]) == gpus
        wanted = ",".join(sorted(UUIDS[int(n.removeprefix("gpu-"))] for n in names))
        for i in range(gpus):  # every CDI device carries the whole claim's environment
            env = _env(spec, i)
            assert env["NVIDIA_VISIBLE_DEVICES"] == env["ROTA_GPU_UUID"] == wanted
            assert env["ROTA_CLAIM_UID"] == uid
            assert env["ROTA_AWAKE_MEMORY_BYTES"] == str(60 * GIB)  # per GPU
            assert env["ROTA_RESIDENT_MEMORY_BYTES"] == str(4 * GIB * gpus)  # summed
        # The engine simulator started from this environment runs one rank per GPU.
        settings = settings_from_args(["--tensor-parallel-size", str(gpus)], _env(spec))
        assert ",".join(settings.worker_gpus) == wanted
        record = eight_gpu_node.ledger()[uid]
        assert sorted(d["deviceName"] for d in record["devices"]) == sorted(names)
        assert sorted(d["gpuUUID"] for d in record["devices"]) == wanted.split(",")
    gone = _prepare(str(eight_gpu_node.dirs.dra_socket), UNPREPARE, claims,
                    api_pb2.NodeUnprepareResourcesRequest,
                    api_pb2.NodeUnprepareResourcesResponse)
    assert all(gone.claims[c["metadata"]["uid"]].error == "" for c in claims)
    assert eight_gpu_node.cdi_specs() == {}

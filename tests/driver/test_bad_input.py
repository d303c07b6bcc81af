"""Bad input of every kind gets a clear per-claim error and changes nothing.

Claims here are allocated by writing their status directly (as an admin could), so each
test can shape exactly the allocation a scheduler bug, a stale object or a hostile user
would produce.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, engine_config
from rota.kit.grpc_services import method_path, unary_client
from rota.pb.dra.v1 import api_pb2 as dra

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

SERVICE = dra.DESCRIPTOR.services_by_name["DRAPlugin"]


def _allocate(api: client.ApiClient, namespace: str, name: str,
              results: list[dict[str, Any]]) -> dict[str, Any]:
    objects = client.CustomObjectsApi(api)
    current = objects.get_namespaced_custom_object(GROUP, VERSION, namespace,
                                                   "resourceclaims", name)
    current["status"] = {"allocation": {"devices": {"results": results}}}
    return dict(objects.replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "resourceclaims", name, current))


def _result(node: GpuNode, **overrides: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": "gpu.rota.dev", "pool": node.name,
              "device": "gpu-0", "shareID": str(uuid.uuid4()),
              "consumedCapacity": {"memory": "4Gi", "engines": "1"}}
    result.update(overrides)
    return {k: v for k, v in result.items() if v is not None}


async def _prepare(node: GpuNode, claims: list[dra.Claim]) -> dra.NodePrepareResourcesResponse:
    async with grpc.aio.insecure_channel(f"unix://{node.dirs.dra_socket}") as channel:
        response: dra.NodePrepareResourcesResponse = await unary_client(
            channel, SERVICE, "NodePrepareResources")(
            dra.NodePrepareResourcesRequest(claims=claims), timeout=30)
        return response


def _ref(obj: dict[str, Any]) -> dra.Claim:
    meta = obj["metadata"]
    return dra.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])


@pytest.mark.parametrize(("case", "results", "config", "expected"), [
    ("unallocated", None, None, "not allocated"),
    ("other driver", [{"driver": "gpu.nvidia.com"}], None, "no device allocated by driver"),
    ("wrong pool", [{"pool": "some-other-node"}], None, "pool"),
    ("unknown device", [{"device": "gpu-7"}], None, "gpu-7"),
    ("no share id", [{"shareID": None}], None, "shareID"),
    ("absurd capacity", [{"consumedCapacity": {"memory": "900Ti", "engines": "1"}}], None,
     "more than its"),
    ("awake budget beyond the GPU", [{}], {"awake": "400Gi"}, "GiB"),
    ("invalid opaque parameters", [{}], {"sleepLevel": 7}, "sleepLevel"),
])
async def test_bad_claims_get_a_clear_error_and_change_nothing(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str, case: str,
        results: list[dict[str, Any]] | None, config: dict[str, Any] | None,
        expected: str) -> None:
    params = engine_config(model="m", awake="20Gi")
    if config and "awake" in config:
        params["awakeMemory"] = config["awake"]
    elif config:
        params.update(config)
    created = create_claim(kube_api, namespace, claim("bad", memory="4Gi", config=params))
    if results is not None:
        created = _allocate(kube_api, namespace, "bad",
                            [_result(gpu_node, **overrides) for overrides in results])
    response = await _prepare(gpu_node, [_ref(created)])
    error = response.claims[created["metadata"]["uid"]].error
    assert expected.lower() in error.lower(), f"{case}: {error}"
    assert not response.claims[created["metadata"]["uid"]].devices
    assert gpu_node.ledger() == {}
    assert gpu_node.cdi_specs() == {}


async def test_a_claim_replaced_under_the_same_name_is_refused(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    first = create_claim(kube_api, namespace, claim("c", memory="4Gi"))
    client.CustomObjectsApi(kube_api).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", "c")
    create_claim(kube_api, namespace, claim("c", memory="4Gi"))
    _allocate(kube_api, namespace, "c", [_result(gpu_node)])
    response = await _prepare(gpu_node, [_ref(first)])
    assert "created again" in response.claims[first["metadata"]["uid"]].error
    assert gpu_node.ledger() == {}


async def test_one_bad_claim_does_not_fail_the_batch(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    good = create_claim(kube_api, namespace, claim("good", memory="4Gi"))
    good = _allocate(kube_api, namespace, "good", [_result(gpu_node)])
    bad = create_claim(kube_api, namespace, claim("bad", memory="4Gi"))
    bad = _allocate(kube_api, namespace, "bad", [_result(gpu_node, pool="elsewhere")])
    response = await _prepare(gpu_node, [_ref(good), _ref(bad)])
    assert response.claims[good["metadata"]["uid"]].error == ""
    assert response.claims[good["metadata"]["uid"]].devices[0].device_name == "gpu-0"
    assert "pool" in response.claims[bad["metadata"]["uid"]].error
    assert set(gpu_node.ledger()) == {good["metadata"]["uid"]}


async def test_unprepare_of_an_unknown_claim_succeeds(gpu_node: GpuNode) -> None:
    async with grpc.aio.insecure_channel(f"unix://{gpu_node.dirs.dra_socket}") as channel:
        response = await unary_client(channel, SERVICE, "NodeUnprepareResources")(
            dra.NodeUnprepareResourcesRequest(claims=[
                dra.Claim(namespace="nowhere", uid="0000-unknown", name="ghost")]), timeout=10)
    assert response.claims["0000-unknown"].error == ""


async def test_malformed_grpc_requests(gpu_node: GpuNode) -> None:
    async with grpc.aio.insecure_channel(f"unix://{gpu_node.dirs.dra_socket}") as channel:
        prepare = unary_client(channel, SERVICE, "NodePrepareResources")
        response = await prepare(dra.NodePrepareResourcesRequest(claims=[
            dra.Claim(namespace="ns", uid="", name="x"),
            dra.Claim(namespace="ns", uid="dup", name="a"),
            dra.Claim(namespace="ns", uid="dup", name="b"),
            dra.Claim(namespace="", uid="no-ns", name="c"),
        ]), timeout=10)
        assert "no uid" in response.claims[""].error
        assert "appears 2 times" in response.claims["dup"].error
        assert "namespace" in response.claims["no-ns"].error
        # Bytes that are not a NodePrepareResourcesRequest at all.
        raw = channel.unary_unary(method_path(SERVICE, "NodePrepareResources"),
                                  request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff garbage", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesRequest" in (
            info.value.details() or "")
        # An unknown method on the DRA socket.
        unknown = channel.unary_unary("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/Nope",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unknown(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert gpu_node.ledger() == {}
    assert gpu_node.driver is not None
    assert gpu_node.driver.alive()


def test_a_corrupt_ledger_stops_the_driver_with_a_clear_message(gpu_node: GpuNode) -> None:
    gpu_node.stop_driver()
    gpu_node.dirs.ledger.write_text('{"apiVersion": "ledger.gpu.rota.dev/v1", "kind": "Ledger",'
                                    ' "checksum": "sha256:00", "data": {}}')
    gpu_node.start_driver(wait=False)
    assert gpu_node.driver is not None
    assert gpu_node.driver.popen is not None
    assert gpu_node.driver.popen.wait(timeout=30) == 1
    assert "ledger" in gpu_node.driver.log_tail().lower()

"""A rolling update: two driver pods on one node at once, each with sockets named after
its pod uid; the old one stops without touching the new one's sockets."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from e2e.harness.local_node import GpuNode
from e2e.harness.waiting import eventually
from rota.kit.grpc_services import unary_client
from rota.pb.dra.v1 import api_pb2 as dra
from rota.pb.pluginregistration import api_pb2 as reg

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

OLD, NEW = "0b1d0000-0000-4000-8000-000000000001", "0b1d0000-0000-4000-8000-000000000002"


def _start(node: GpuNode, pod_uid: str) -> tuple[object, int]:
    node.start_driver(wait=False, extra=[f"--pod-uid={pod_uid}"])
    port = node.http_port

    def ready() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)

    eventually(ready, timeout=30, what=f"driver {pod_uid} ready")
    return node.driver, port


async def test_two_driver_pods_overlap(gpu_node: GpuNode) -> None:
    gpu_node.stop_driver()
    old, _ = _start(gpu_node, OLD)
    new, _ = _start(gpu_node, NEW)
    registry, plugin = gpu_node.dirs.registry, gpu_node.dirs.plugin
    sockets = {uid: (registry / f"gpu.rota.dev-{uid}-reg.sock", plugin / f"dra-{uid}.sock")
               for uid in (OLD, NEW)}
    for uid, (registration, dra_socket) in sockets.items():
        async with grpc.aio.insecure_channel(f"unix://{registration}") as channel:
            info = await unary_client(channel, reg.DESCRIPTOR.services_by_name["Registration"],
                                      "GetInfo")(reg.InfoRequest(), timeout=5)
        assert info.endpoint == str(dra_socket), uid
        async with grpc.aio.insecure_channel(f"unix://{dra_socket}") as channel:
            answer = await unary_client(channel, dra.DESCRIPTOR.services_by_name["DRAPlugin"],
                                        "NodeUnprepareResources")(
                dra.NodeUnprepareResourcesRequest(claims=[
                    dra.Claim(namespace="ns", uid="gone", name="c")]), timeout=5)
        assert answer.claims["gone"].error == ""

    old.stop()  # type: ignore[attr-defined]
    assert not sockets[OLD][0].exists()
    assert not sockets[OLD][1].exists()
    assert sockets[NEW][0].exists(), "the old driver removed the new one's socket"
    assert sockets[NEW][1].exists()
    assert gpu_node.dirs.inspect_socket.exists(), "the shared inspection socket went away"
    new.stop()  # type: ignore[attr-defined]

"""Wire compatibility: a client built only from the proto definitions, using the full
method names the kubelet uses, registers the plugin and prepares and unprepares claims on
v1 and v1beta1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.objects import claim, create_claim, engine_config, engine_pod, read_claim
from e2e.harness.waiting import eventually
from rota.pb.dra.v1 import api_pb2 as generated_v1

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

PREPARE_V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE_V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
PREPARE_V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources"
UNPREPARE_V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources"
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"


def _kubelet_messages(package: str, with_share_id: bool) -> dict[str, Any]:
    """Message classes built from a hand-written descriptor of the kubelet's proto, in a
    private pool: nothing of rota's generated code is used on the client side."""
    f = descriptor_pb2.FileDescriptorProto(name=f"kubelet/{package}.proto", package=package,
                                           syntax="proto3")
    string, msg = descriptor_pb2.FieldDescriptorProto.TYPE_STRING, \
        descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
    rep, opt = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED, \
        descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL

    def message(name: str, fields: Sequence[tuple[str, int, Any, Any, str]]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = f".{package}.{type_name}"

    message("Claim", [("namespace", 1, string, opt, ""), ("uid", 2, string, opt, ""),
                      ("name", 3, string, opt, "")])
    device_fields: list[tuple[str, int, Any, Any, str]] = [
        ("request_names", 1, string, rep, ""), ("pool_name", 2, string, opt, ""),
        ("device_name", 3, string, opt, ""), ("cdi_device_ids", 4, string, rep, "")]
    if with_share_id:
        device_fields.append(("share_id", 5, string, opt, ""))
    message("Device", device_fields)
    message("NodePrepareResourcesRequest", [("claims", 1, msg, rep, "Claim")])
    message("NodePrepareResourceResponse", [("devices", 1, msg, rep, "Device"),
                                            ("error", 2, string, opt, "")])
    response = f.message_type.add(name="NodePrepareResourcesResponse")
    entry = response.nested_type.add(name="ClaimsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=string, label=opt)
    entry.field.add(name="value", number=2, type=msg, label=opt,
                    type_name=f".{package}.NodePrepareResourceResponse")
    response.field.add(name="claims", number=1, type=msg, label=rep,
                       type_name=f".{package}.NodePrepareResourcesResponse.ClaimsEntry")
    message("NodeUnprepareResourcesRequest", [("claims", 1, msg, rep, "Claim")])
    message("NodeUnprepareResourceResponse", [("error", 1, string, opt, "")])
    uresponse = f.message_type.add(name="NodeUnprepareResourcesResponse")
    uentry = uresponse.nested_type.add(name="ClaimsEntry")
    uentry.options.map_entry = True
    uentry.field.add(name="key", number=1, type=string, label=opt)
    uentry.field.add(name="value", number=2, type=msg, label=opt,
                     type_name=f".{package}.NodeUnprepareResourceResponse")
    uresponse.field.add(name="claims", number=1, type=msg, label=rep,
                        type_name=f".{package}.NodeUnprepareResourcesResponse.ClaimsEntry")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    names = ["Claim", "NodePrepareResourcesRequest", "NodePrepareResourcesResponse",
             "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"]
    return {n: GetMessageClass(pool.FindMessageTypeByName(f"{package}.{n}")) for n in names}


def _registration_messages() -> dict[str, Any]:
    f = descriptor_pb2.FileDescriptorProto(name="kubelet/reg.proto",
                                           package="pluginregistration", syntax="proto3")
    t = descriptor_pb2.FieldDescriptorProto
    info = f.message_type.add(name="PluginInfo")
    for name, number, label in (("type", 1, t.LABEL_OPTIONAL), ("name", 2, t.LABEL_OPTIONAL),
                                ("endpoint", 3, t.LABEL_OPTIONAL),
                                ("supported_versions", 4, t.LABEL_REPEATED)):
        info.field.add(name=name, number=number, type=t.TYPE_STRING, label=label)
    status = f.message_type.add(name="RegistrationStatus")
    status.field.add(name="plugin_registered", number=1, type=t.TYPE_BOOL,
                     label=t.LABEL_OPTIONAL)
    status.field.add(name="error", number=2, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    f.message_type.add(name="RegistrationStatusResponse")
    f.message_type.add(name="InfoRequest")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {n: GetMessageClass(pool.FindMessageTypeByName(f"pluginregistration.{n}"))
            for n in ("PluginInfo", "RegistrationStatus", "RegistrationStatusResponse",
                      "InfoRequest")}


def _call(socket: str, method: str, request: Any, response_cls: Any) -> Any:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_cls.FromString)
        return stub(request, timeout=30)


def _allocated_claims(api: client.ApiClient, namespace: str, node: str, count: int
                      ) -> list[dict[str, Any]]:
    core = client.CoreV1Api(api)
    names = []
    for i in range(count):
        create_claim(api, namespace, claim(f"c{i}", memory="4Gi",
                                           config=engine_config(model=f"m{i}", awake="20Gi")))
        core.create_namespaced_pod(namespace, engine_pod(f"p{i}", node=node,
                                                         claim_name=f"c{i}"))
        names.append(f"c{i}")
    eventually(lambda: all(read_claim(api, namespace, n).get("status", {}).get("allocation")
                           for n in names), timeout=60, what="claims allocated")
    return [read_claim(api, namespace, n) for n in names]


def test_registration_as_the_kubelet_does_it(gpu_node: GpuNode) -> None:
    reg = _registration_messages()
    info = _call(str(gpu_node.dirs.registration_socket), GET_INFO, reg["InfoRequest"](),
                 reg["PluginInfo"])
    assert info.type == "DRAPlugin"
    assert info.name == "gpu.rota.dev"
    assert info.endpoint == str(gpu_node.dirs.dra_socket)
    assert next(iter(info.supported_versions)) == "v1.DRAPlugin"
    assert "v1beta1.DRAPlugin" in info.supported_versions
    _call(str(gpu_node.dirs.registration_socket), NOTIFY,
          reg["RegistrationStatus"](plugin_registered=True), reg["RegistrationStatusResponse"])


@pytest.mark.parametrize(("package", "prepare", "unprepare", "with_share_id"), [
    ("k8s.io.kubelet.pkg.apis.dra.v1", PREPARE_V1, UNPREPARE_V1, True),
    ("k8s.io.kubelet.pkg.apis.dra.v1beta1", PREPARE_V1BETA1, UNPREPARE_V1BETA1, False),
])
def test_prepare_and_unprepare_over_the_wire(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str, package: str,
        prepare: str, unprepare: str, with_share_id: bool) -> None:
    m = _kubelet_messages(package, with_share_id)
    claims = _allocated_claims(kube_api, namespace, gpu_node.name, 2)
    request = m["NodePrepareResourcesRequest"](claims=[
        m["Claim"](namespace=namespace, uid=c["metadata"]["uid"],
                   name=c["metadata"]["name"]) for c in claims])
    socket = str(gpu_node.dirs.dra_socket)
    response = _call(socket, prepare, request, m["NodePrepareResourcesResponse"])
    specs = gpu_node.cdi_specs()
    for c in claims:
        uid = c["metadata"]["uid"]
        result = c["status"]["allocation"]["devices"]["results"][0]
        entry = response.claims[uid]
        assert entry.error == ""
        (device,) = entry.devices
        assert (device.pool_name, device.device_name) == (gpu_node.name, "gpu-0")
        assert list(device.request_names) == ["gpu"]
        assert device.cdi_device_ids[0].startswith("k8s.gpu.rota.dev/claim=")
        if with_share_id:
            assert device.share_id == result["shareID"]
        assert uid in specs
    # Preparing again answers the same devices and writes nothing new.
    again = _call(socket, prepare, request, m["NodePrepareResourcesResponse"])
    assert again == response
    gone = _call(socket, unprepare, m["NodeUnprepareResourcesRequest"](claims=request.claims),
                 m["NodeUnprepareResourcesResponse"])
    assert all(gone.claims[c.uid].error == "" for c in request.claims)
    assert gpu_node.cdi_specs() == {}
    assert gpu_node.ledger() == {}


def test_generated_and_hand_built_descriptors_agree() -> None:
    """rota's generated v1 module serialises exactly like the hand-built kubelet schema."""
    m = _kubelet_messages("k8s.io.kubelet.pkg.apis.dra.v1", with_share_id=True)
    ours = generated_v1.NodePrepareResourcesRequest(
        claims=[generated_v1.Claim(namespace="ns", uid="u-1", name="n")])
    theirs = m["NodePrepareResourcesRequest"].FromString(ours.SerializeToString())
    assert theirs.claims[0].uid == "u-1"
    assert generated_v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"

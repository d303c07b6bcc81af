"""The node agent's gRPC client side: registration and DRA calls, exactly as the kubelet
makes them (same sockets, full method names and messages)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from rota.kit.grpc_services import unary_client
from rota.pb.dra.v1 import api_pb2 as dra_v1
from rota.pb.pluginregistration import api_pb2 as reg_pb

log = logging.getLogger(__name__)

REGISTRATION = reg_pb.DESCRIPTOR.services_by_name["Registration"]
DRA_V1 = dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"]
KUBELET_SUPPORTED = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CALL_TIMEOUT_S = 45.0  # the kubelet's default per-call timeout


class RegistrationError(RuntimeError):
    """A registration socket answered with something the kubelet would reject."""


@dataclass(frozen=True)
class DriverEndpoint:
    name: str
    endpoint: str
    service: str


async def register(socket_path: Path, *, timeout_s: float = 5.0) -> DriverEndpoint:
    """GetInfo, validate as the kubelet does, then NotifyRegistrationStatus."""
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        info: reg_pb.PluginInfo = await unary_client(channel, REGISTRATION, "GetInfo")(
            reg_pb.InfoRequest(), timeout=timeout_s)
        problem = ""
        chosen = next((v for v in info.supported_versions if v in KUBELET_SUPPORTED), "")
        if info.type != "DRAPlugin":
            problem = f"plugin type {info.type!r} is not DRAPlugin"
        elif not chosen:
            problem = f"no supported DRA service in {list(info.supported_versions)}"
        elif not info.endpoint.startswith("/"):
            problem = f"endpoint {info.endpoint!r} is not an absolute path"
        await unary_client(channel, REGISTRATION, "NotifyRegistrationStatus")(
            reg_pb.RegistrationStatus(plugin_registered=not problem, error=problem),
            timeout=timeout_s)
        if problem:
            raise RegistrationError(f"{socket_path}: {problem}")
        log.info("registered DRA driver", extra={"driver": info.name,
                                                 "endpoint": info.endpoint,
                                                 "service": chosen})
        return DriverEndpoint(name=info.name, endpoint=info.endpoint, service=chosen)


async def discover(registry_dir: Path) -> dict[str, DriverEndpoint]:
    """Register every DRA plugin socket found in ``registry_dir``."""
    found: dict[str, DriverEndpoint] = {}
    sockets = await asyncio.to_thread(lambda: sorted(registry_dir.glob("*.sock")))
    for path in sockets:
        if path.name.startswith("."):
            continue
        try:
            endpoint = await register(path)
        except (grpc.aio.AioRpcError, RegistrationError) as exc:
            log.warning("plugin socket did not register", extra={"socket": str(path),
                                                                  "error": str(exc)[:300]})
            continue
        found[endpoint.name] = endpoint
    return found


async def prepare(endpoint: DriverEndpoint, claims: list[tuple[str, str, str]]
                  ) -> dra_v1.NodePrepareResourcesResponse:
    """NodePrepareResources with (namespace, uid, name) claims over v1."""
    request = dra_v1.NodePrepareResourcesRequest(
        claims=[dra_v1.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
    async with grpc.aio.insecure_channel(f"unix://{endpoint.endpoint}") as channel:
        response: dra_v1.NodePrepareResourcesResponse = await unary_client(
            channel, DRA_V1, "NodePrepareResources")(request, timeout=CALL_TIMEOUT_S)
        return response


async def unprepare(endpoint: DriverEndpoint, claims: list[tuple[str, str, str]]
                    ) -> dra_v1.NodeUnprepareResourcesResponse:
    request = dra_v1.NodeUnprepareResourcesRequest(
        claims=[dra_v1.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
    async with grpc.aio.insecure_channel(f"unix://{endpoint.endpoint}") as channel:
        response: dra_v1.NodeUnprepareResourcesResponse = await unary_client(
            channel, DRA_V1, "NodeUnprepareResources")(request, timeout=CALL_TIMEOUT_S)
        return response

"""HTTP endpoints for the kubelet's probes and Prometheus: /healthz, /readyz, /metrics.

Liveness probes the real path: it dials the driver's own registration and DRA sockets
and makes the calls the kubelet makes (``GetInfo`` and an empty
``NodePrepareResources``), so a wedged gRPC server fails the probe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from driver import metrics
from rota.kit.grpc_services import unary_client
from rota.pb.dra.v1 import api_pb2 as dra_v1
from rota.pb.pluginregistration import api_pb2 as reg_pb

_PROBE_TIMEOUT_S = 3.0


async def self_check(registration_socket: Path, dra_socket: Path) -> str:
    """Empty string when both sockets answer as the kubelet expects, else the problem."""
    try:
        async with grpc.aio.insecure_channel(f"unix://{registration_socket}") as channel:
            info = await unary_client(channel, reg_pb.DESCRIPTOR.services_by_name[
                "Registration"], "GetInfo")(reg_pb.InfoRequest(), timeout=_PROBE_TIMEOUT_S)
        async with grpc.aio.insecure_channel(f"unix://{dra_socket}") as channel:
            await unary_client(channel, dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"],
                               "NodePrepareResources")(
                dra_v1.NodePrepareResourcesRequest(), timeout=_PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    if info.endpoint != str(dra_socket):
        return f"registration names {info.endpoint}, expected {dra_socket}"
    return ""


def make_app(*, registration_socket: Path, dra_socket: Path,
             ready: Callable[[], str], wedged: Callable[[], str] = lambda: ""
             ) -> web.Application:
    """``ready()`` returns an empty string when ready, else why not; ``wedged()`` likewise
    says why the driver is alive but stuck (a call in flight far past its deadline), which
    fails the liveness probe so that the kubelet restarts the container."""

    async def healthz(request: web.Request) -> web.Response:
        problem = wedged() or await self_check(registration_socket, dra_socket)
        return web.Response(status=503 if problem else 200, text=problem or "ok\n")

    async def readyz(request: web.Request) -> web.Response:
        problem = ready()
        return web.Response(status=503 if problem else 200, text=problem or "ok\n")

    async def metrics_page(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    return app

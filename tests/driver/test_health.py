"""NVML health events reach the kubelet's DRA health stream over a real socket: a
device-side XID marks the GPU unhealthy; an XID a program caused does not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from driver.claims import PublishedDevice
from driver.health import HealthMonitor
from driver.nvml import fixture_path
from driver.nvml.api import HealthEvent, HealthEventKind
from driver.nvml.fake import FakeNvml
from rota.kit.grpc_services import stream_client
from rota.kit.sockets import UnixServer
from rota.pb.drahealth.v1 import api_pb2 as pb_v1
from rota.pb.drahealth.v1alpha1 import api_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"]
SERVICE_V1 = pb_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"]


async def test_xid_events_become_device_health(short_tmp: Path) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    uuid = backend.uuid(0)
    devices = {"gpu-0": PublishedDevice(name="gpu-0", gpu_uuid=uuid, gpu_index=0,
                                        gpu_memory_bytes=1 << 40, capacity_memory_bytes=1 << 40,
                                        shared=True)}
    monitor = HealthMonitor(backend=backend, pool="node-1", devices=lambda: devices)
    server = UnixServer(short_tmp / "dra.sock", [monitor.handler()])
    stop = asyncio.Event()
    await server.start()
    runner = asyncio.create_task(monitor.run(stop))
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'dra.sock'}") as channel:
            stream = stream_client(channel, SERVICE, "NodeWatchResources")(
                pb.NodeWatchResourcesRequest(), timeout=30)
            first = await stream.read()
            assert isinstance(first, pb.NodeWatchResourcesResponse)
            (device,) = first.devices
            assert (device.device.pool_name, device.device.device_name) == ("node-1", "gpu-0")
            assert device.health == pb.HEALTHY

            # An application XID (31: a program's page fault) leaves the device healthy;
            # the device-side XID after it (79: fallen off the bus) does not.
            backend.inject_health_event(HealthEvent(uuid, HealthEventKind.XID, 31, "mmu fault"))
            backend.inject_health_event(HealthEvent(uuid, HealthEventKind.XID, 79,
                                                    "GPU has fallen off the bus"))
            second = await stream.read()
            assert isinstance(second, pb.NodeWatchResourcesResponse)
            (device,) = second.devices
            assert device.health == pb.UNHEALTHY
            assert "fallen off the bus" in device.message
            stream.cancel()
    finally:
        stop.set()
        await runner
        await server.stop(0)
        backend.shutdown()


async def test_v1_stream_resends_its_snapshot_without_changes(short_tmp: Path) -> None:
    # The kubelet stamps each report on receipt and calls a device Unknown 30 s after the
    # last one: the snapshot must come again while nothing changes.
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    devices = {"gpu-0": PublishedDevice(name="gpu-0", gpu_uuid=backend.uuid(0), gpu_index=0,
                                        gpu_memory_bytes=1 << 40, capacity_memory_bytes=1 << 40,
                                        shared=True)}
    monitor = HealthMonitor(backend=backend, pool="node-1", devices=lambda: devices,
                            resend_s=0.2)
    assert HealthMonitor(backend=backend, pool="p", devices=dict).resend_s <= 10
    server = UnixServer(short_tmp / "dra.sock", monitor.handlers())
    stop = asyncio.Event()
    await server.start()
    runner = asyncio.create_task(monitor.run(stop))
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_tmp / 'dra.sock'}") as channel:
            stream = stream_client(channel, SERVICE_V1, "NodeWatchResources")(
                pb_v1.NodeWatchResourcesRequest(), timeout=30)
            for _ in range(3):
                answer = await stream.read()
                assert isinstance(answer, pb_v1.NodeWatchResourcesResponse)
                (device,) = answer.devices
                assert device.health == pb_v1.HEALTHY
            stream.cancel()
    finally:
        stop.set()
        await runner
        await server.stop(0)
        backend.shutdown()


async def test_registration_advertises_health_v1_before_v1alpha1() -> None:
    from driver.rpc.registration import RegistrationService

    service = RegistrationService(driver_name="gpu.rota.dev", dra_endpoint=Path("/x.sock"))
    info = await service.get_info(None, None)  # type: ignore[arg-type]
    versions = list(info.supported_versions)
    assert versions[0] == "v1.DRAPlugin"
    assert versions.index("v1.DRAResourceHealth") < versions.index("v1alpha1.DRAResourceHealth")

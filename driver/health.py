"""Device health: NVML XID and ECC events become the kubelet's DRA health stream.

A monitor thread waits on NVML events (the call blocks, so it never runs on the loop).
A double-bit ECC error or a device-side XID marks the GPU unhealthy; XIDs a program
causes (31, 43, 45, ...) are logged and leave the device healthy. Every subscriber of
``NodeWatchResources`` gets the complete list at once, again on each change, and again
every ``resend_s`` (5 s) without one: the kubelet stamps a report when it receives it and
calls a device Unknown 30 s after the last.

The service is served as ``v1.DRAResourceHealth`` (what the 1.37 kubelet dials when
offered) and ``v1alpha1.DRAResourceHealth`` (older kubelets; removed in 1.40): the same
messages in two packages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from driver import metrics
from driver.claims import PublishedDevice
from driver.errors import NvmlError
from driver.nvml.api import NvmlBackend
from rota.kit.grpc_services import generic_handler
from rota.pb.drahealth.v1 import api_pb2 as pb_v1
from rota.pb.drahealth.v1alpha1 import api_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"]
SERVICE_V1 = pb_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"]
RESEND_S = 5.0
"""Re-send the snapshot this often without changes (the kubelet's staleness is 30 s)."""


@dataclass(frozen=True)
class GpuHealth:
    healthy: bool
    message: str
    since: float


class HealthMonitor:
    """Holds each GPU's health and tells subscribers about changes."""

    def __init__(self, *, backend: NvmlBackend, pool: str,
                 devices: Callable[[], Mapping[str, PublishedDevice]],
                 on_change: Callable[[str, bool, str], None] | None = None,
                 resend_s: float = RESEND_S) -> None:
        """``on_change(gpu_uuid, healthy, label)`` runs on the event loop after each change
        (the publisher taints the GPU's devices); ``label`` is short, e.g. ``xid-79``."""
        self.backend = backend
        self.on_change = on_change
        self.pool = pool
        self.devices = devices
        self.resend_s = resend_s
        self._health: dict[str, GpuHealth] = {}
        self._version = 0
        self._changed = asyncio.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None

    def health_of(self, gpu_uuid: str) -> GpuHealth:
        return self._health.get(gpu_uuid, GpuHealth(True, "", 0.0))

    def snapshot(self, api: Any = pb) -> Any:
        """The complete list, as a ``NodeWatchResourcesResponse`` of ``api`` (the
        generated module of v1alpha1 or v1)."""
        response = api.NodeWatchResourcesResponse()
        for name, device in sorted(self.devices().items()):
            health = self.health_of(device.gpu_uuid)
            response.devices.add(
                device=api.DeviceIdentifier(pool_name=self.pool, device_name=name),
                health=api.HEALTHY if health.healthy else api.UNHEALTHY,
                last_updated_time=int(health.since or time.time()),
                message=health.message[:1024])
            metrics.DEVICE_HEALTHY.labels(name, device.gpu_uuid).set(1 if health.healthy else 0)
        return response

    def _mark(self, gpu_uuid: str, healthy: bool, message: str, label: str) -> None:
        self._health[gpu_uuid] = GpuHealth(healthy, message, time.time())
        self._version += 1
        if self._loop is not None:
            changed = self._changed
            if self.on_change is not None:
                self._loop.call_soon_threadsafe(self.on_change, gpu_uuid, healthy, label)

            async def notify() -> None:
                async with changed:
                    changed.notify_all()

            asyncio.run_coroutine_threadsafe(notify(), self._loop)

    def watch_events(self, stop: threading.Event) -> None:
        """Blocking loop for a worker thread: turn NVML events into health changes."""
        while not stop.is_set():
            try:
                event = self.backend.wait_health_event(1000)
            except NvmlError as exc:
                metrics.NVML_ERRORS.labels(exc.reason).inc()
                log.warning("waiting for NVML events failed", extra={"error": str(exc)})
                stop.wait(5)
                continue
            if event is None:
                continue
            fields = {"gpu": event.gpu_uuid, "kind": event.kind.value, "xid": event.xid}
            if event.is_application_error:
                log.info("application XID; device stays healthy", extra=fields)
                continue
            log.error("device unhealthy", extra={**fields, "detail": event.message})
            label = f"xid-{event.xid}" if event.xid is not None else event.kind.value
            self._mark(event.gpu_uuid, False, f"{event.kind.value}: {event.message}", label)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        halt = threading.Event()
        thread = threading.Thread(target=self.watch_events, args=(halt,), name="nvml-events",
                                  daemon=True)
        thread.start()
        try:
            await stop.wait()
        finally:
            halt.set()
            await asyncio.to_thread(thread.join, 2)

    async def _watch(self, api: Any) -> AsyncIterator[Any]:
        while True:
            seen = self._version
            yield self.snapshot(api)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_past(seen), self.resend_s)

    async def watch(self, request: pb.NodeWatchResourcesRequest,
                    context: grpc.aio.ServicerContext[Any, Any]
                    ) -> AsyncIterator[pb.NodeWatchResourcesResponse]:
        async for answer in self._watch(pb):
            yield answer

    async def watch_v1(self, request: pb_v1.NodeWatchResourcesRequest,
                       context: grpc.aio.ServicerContext[Any, Any]
                       ) -> AsyncIterator[pb_v1.NodeWatchResourcesResponse]:
        async for answer in self._watch(pb_v1):
            yield answer

    async def _wait_past(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != version)

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        """Both versions of the service."""
        return [generic_handler(SERVICE_V1, {"NodeWatchResources": self.watch_v1}),
                generic_handler(SERVICE, {"NodeWatchResources": self.watch})]

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The v1alpha1 service alone."""
        return generic_handler(SERVICE, {"NodeWatchResources": self.watch})

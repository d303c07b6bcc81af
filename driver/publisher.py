"""Keeps this node's ResourceSlices present and equal to what the driver would publish.

Slices are reconciled, not published once: the kubelet deletes a node's slices when it
restarts, and a driver's slices when the driver has been gone for 30 s; an admin may
delete them by hand. A watch on our slices wakes the loop, and a periodic resync catches
anything a watch missed.

Writes happen only when something differs, so a restarted driver that finds its slices
intact writes nothing. The pool generation goes up only when the content changes.

When the API server silently drops fields rota wrote (a feature gate is off), the answer
differs from the request. The publisher logs one clear line naming the gate, falls back to
the next sharing mode (shared -> partitioned -> exclusive) and publishes that; it never
loops on updates the server will keep rewriting.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Mapping
from typing import Any

from driver import DRIVER_NAME, metrics
from driver.aio import Backoff, wait_any
from driver.claims import PublishedDevice
from driver.devices import GpuDevice
from driver.errors import KubeConflictError, KubeError
from driver.kube import Kube
from driver.quantity import parse_quantity
from driver.slices import (
    GATE_DEVICE_TAINTS,
    PoolOptions,
    SharingMode,
    build_slices,
    content_equal,
    dropped_fields,
    dropped_gates,
    fallback_mode,
    unhealthy_taint,
    with_taints,
)

log = logging.getLogger(__name__)

_MAX_PASSES = 4  # a sync that falls back or loses a race retries at most this often


def published_devices(slices: list[dict[str, Any]], gpus: list[GpuDevice]
                      ) -> dict[str, PublishedDevice]:
    """What prepare needs to know about each device, read from the slice bodies themselves,
    so it can never disagree with what was published."""
    by_index = {gpu.index: gpu for gpu in gpus}
    devices: dict[str, PublishedDevice] = {}
    for body in slices:
        for device in body["spec"].get("devices", []):
            gpu = by_index[int(device["attributes"]["index"]["int"])]
            devices[device["name"]] = PublishedDevice(
                name=device["name"], gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                gpu_memory_bytes=gpu.memory_bytes,
                capacity_memory_bytes=parse_quantity(device["capacity"]["memory"]["value"]),
                shared=bool(device.get("allowMultipleAllocations")), gpu_minor=gpu.minor)
    return devices


class SlicePublisher:
    """Reconciles the pool ``<node name>`` of driver ``gpu.rota.dev``."""

    def __init__(self, *, kube: Kube, node_name: str, gpus: list[GpuDevice],
                 mode: SharingMode, engines: int, resync_s: float = 30.0,
                 driver: str = DRIVER_NAME) -> None:
        self.kube = kube
        self.node_name = node_name
        self.gpus = gpus
        self.requested_mode = mode
        self.mode = mode
        self.engines = engines
        self.resync_s = resync_s
        self.driver = driver
        self.synced = asyncio.Event()
        self._node_uid: str | None = None
        self._taints: dict[str, list[dict[str, Any]]] = {}
        self._taints_supported = True
        self._changed = asyncio.Event()
        self._devices = published_devices(self._desired(0), gpus)
        self._set_mode_metric()

    # -- what is published ---------------------------------------------------------------

    def devices(self) -> Mapping[str, PublishedDevice]:
        return self._devices

    def _desired(self, generation: int) -> list[dict[str, Any]]:
        options = PoolOptions(node_name=self.node_name, node_uid=self._node_uid,
                              generation=generation, mode=self.mode, engines=self.engines,
                              driver=self.driver)
        slices = build_slices(self.gpus, options)
        return with_taints(slices, self._taints) if self._taints_supported else slices

    def set_health(self, gpu_uuid: str, healthy: bool, reason: str) -> None:
        """Taint (NoSchedule) the devices of an unhealthy GPU, or lift the taint; the next
        reconciliation publishes it. Call from the event loop."""
        if healthy:
            changed = self._taints.pop(gpu_uuid, None) is not None
        else:
            since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            changed = gpu_uuid not in self._taints
            self._taints[gpu_uuid] = [unhealthy_taint(reason, since)]
        if changed:
            self._changed.set()

    def _set_mode_metric(self) -> None:
        metrics.set_sharing_mode(self.mode.value, (mode.value for mode in SharingMode))

    # -- one reconciliation --------------------------------------------------------------

    async def sync_once(self) -> int:
        """Make the published slices equal to the desired ones; return the writes made."""
        if self._node_uid is None:
            node = await self.kube.get_node(self.node_name)
            self._node_uid = str(node["metadata"]["uid"])
        writes = 0
        for _ in range(_MAX_PASSES):
            try:
                made, fell_back = await self._pass()
            except KubeConflictError as exc:
                log.info("slice write lost a race; re-reading", extra={"error": str(exc)})
                continue
            writes += made
            if not fell_back:
                break
        self._devices = published_devices(self._desired(0), self.gpus)
        metrics.SLICE_SYNCS.inc()
        self.synced.set()
        return writes

    async def _pass(self) -> tuple[int, bool]:
        observed = {s["metadata"]["name"]: s for s in
                    await self.kube.list_slices(driver=self.driver, node=self.node_name)}
        ours = {n: s for n, s in observed.items()
                if s["spec"].get("pool", {}).get("name") == self.node_name}
        generation = max((int(s["spec"]["pool"].get("generation", 0)) for s in ours.values()),
                         default=0)
        desired = self._desired(generation)
        wanted = {s["metadata"]["name"] for s in desired}
        if set(observed) == wanted and all(
                content_equal(s, observed[s["metadata"]["name"]]) for s in desired):
            return 0, False
        if ours:
            desired = self._desired(generation + 1)
        writes = 0
        for name, stale in observed.items():
            if name not in wanted:
                await self.kube.delete_slice(name, uid=stale["metadata"].get("uid"),
                                             resource_version=stale["metadata"].get(
                                                 "resourceVersion"))
                metrics.SLICE_WRITES.labels("delete").inc()
                writes += 1
        for body in desired:
            name = body["metadata"]["name"]
            if name in observed:
                update = {**body, "metadata": {**body["metadata"], "resourceVersion":
                                               observed[name]["metadata"]["resourceVersion"]}}
                returned = await self.kube.replace_slice(update)
                metrics.SLICE_WRITES.labels("update").inc()
            else:
                returned = await self.kube.create_slice(body)
                metrics.SLICE_WRITES.labels("create").inc()
            writes += 1
            if self._fall_back_if_dropped(body, returned):
                return writes, True
        log.info("published slices", extra={"node": self.node_name, "mode": self.mode.value,
                                            "generation": desired[0]["spec"]["pool"][
                                                "generation"], "slices": len(desired)})
        return writes, False

    def _fall_back_if_dropped(self, desired: dict[str, Any], returned: dict[str, Any]) -> bool:
        gates = dropped_gates(desired, returned)
        if not gates:
            return False
        if gates == {GATE_DEVICE_TAINTS}:
            # Health still reaches the kubelet; only the scheduler-visible taint is lost.
            log.error("the API server dropped device taints (gate DRADeviceTaints off?); "
                      "unhealthy GPUs are reported through the kubelet only",
                      extra={"node": self.node_name})
            self._taints_supported = False
            return True
        fields = dropped_fields(desired, returned)
        fallback = fallback_mode(self.mode, gates)
        if fallback is None:
            log.error("the API server dropped fields rota needs and no fallback is left; "
                      "publishing as returned", extra={"fields": fields[:8]})
            return False
        log.error(
            f"the API server dropped {', '.join(sorted(gates))} fields; sharing mode "
            f"{self.mode.value} is not available on this cluster, publishing "
            f"{fallback.value} instead",
            extra={"node": self.node_name, "from_mode": self.mode.value,
                   "to_mode": fallback.value, "gates": sorted(gates), "fields": fields[:8]})
        self.mode = fallback
        self._set_mode_metric()
        return True

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile on every watch event and at least every ``resync_s``."""
        loop = asyncio.get_running_loop()
        changed = self._changed
        halt = threading.Event()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(changed.set)

        watcher = self.kube.watch_slices(driver=self.driver, node=self.node_name,
                                         on_event=on_event, stop=halt)
        backoff = Backoff(first_s=0.2, max_s=10.0)
        try:
            while not stop.is_set():
                changed.clear()
                try:
                    await self.sync_once()
                    backoff.reset()
                    timeout = self.resync_s
                except KubeError as exc:
                    timeout = backoff.next_delay()
                    log.warning("slice sync failed; retrying", extra={"error": str(exc),
                                                                      "backoff_s": timeout})
                await wait_any(changed, stop, timeout_s=timeout)
        finally:
            halt.set()
            await asyncio.to_thread(watcher.join, 1)

"""Keeps this node's ResourceSlices present and equal to what the driver would publish.

Slices are reconciled, not published once: the kubelet deletes a node's slices when it
restarts, and a driver's slices when the driver has been gone for 30 s; an admin may
delete them by hand. A list-watch of our slices (:class:`rota.kit.listwatch.ListWatch`)
keeps a view of them and wakes the loop; a reconciliation compares the desired slices with
that view, so a node whose slices are intact costs the API server nothing but the watch.
A write that loses a race (409) re-reads by a list; the watch lists again every
``relist_s`` (and after a 410), which catches anything it missed.

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
from collections.abc import Mapping
from typing import Any

from driver import DRIVER_NAME, metrics
from driver.claims import PublishedDevice
from driver.devices import GpuDevice
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
from rota.api.quantity import parse_quantity
from rota.kit.aio import Backoff, wait_any
from rota.kit.errors import KubeConflictError, KubeError
from rota.kit.kube import Kube
from rota.kit.listwatch import Obj

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
                 relist_s: float = 600.0, driver: str = DRIVER_NAME) -> None:
        self.kube = kube
        self.node_name = node_name
        self.gpus = gpus
        self.requested_mode = mode
        self.mode = mode
        self.engines = engines
        self.resync_s = resync_s
        self.relist_s = relist_s
        self.driver = driver
        self._view: dict[str, Obj] | None = None
        """Our slices by name, as the watch (and this publisher's own writes) left them;
        None until the watch has listed."""
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
        fresh = False
        for _ in range(_MAX_PASSES):
            try:
                made, fell_back = await self._pass(fresh=fresh)
            except KubeConflictError as exc:
                log.info("slice write lost a race; re-reading", extra={"error": str(exc)})
                fresh = True
                continue
            writes += made
            if not fell_back:
                break
        self._devices = published_devices(self._desired(0), self.gpus)
        metrics.SLICE_SYNCS.inc()
        self.synced.set()
        return writes

    async def _observed(self, *, fresh: bool) -> dict[str, Obj]:
        """Our slices: the watch's view, or a list when there is none yet or ``fresh``."""
        if self._view is not None and not fresh:
            return dict(self._view)
        return {s["metadata"]["name"]: s for s in
                await self.kube.list_slices(driver=self.driver, node=self.node_name)}

    def _wrote(self, name: str, returned: Obj | None) -> None:
        """What a write returned is the newest version: the view has it before the event."""
        if self._view is None:
            return
        if returned is None:
            self._view.pop(name, None)
        else:
            self._view[name] = returned

    async def _pass(self, *, fresh: bool = False) -> tuple[int, bool]:
        observed = await self._observed(fresh=fresh)
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
                self._wrote(name, None)
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
            self._wrote(name, returned)
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
        """Reconcile on every change the watch sees and at least every ``resync_s``."""
        changed = self._changed

        def replace(items: list[Obj]) -> None:
            self._view = {o["metadata"]["name"]: o for o in items}
            changed.set()

        def event(kind: str, obj: Obj) -> None:
            if self._view is not None:
                if kind == "DELETED":
                    self._view.pop(obj["metadata"]["name"], None)
                else:
                    self._view[obj["metadata"]["name"]] = obj
            changed.set()

        watch = self.kube.slice_watch(driver=self.driver, node=self.node_name,
                                      loop=asyncio.get_running_loop(), on_replace=replace,
                                      on_event=event, relist_s=self.relist_s)
        watch.start()
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
            watch.stop()
            self._view = None

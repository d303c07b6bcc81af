"""rota's per-node processes, many nodes in one asyncio process, built from their real classes.

Each emulated node runs what its driver and lease controller say to the API server, with
the same classes, cadences (their settings' defaults), User-Agents and client-side rate
limits (one client, one token bucket per process, as each real process has):

- driver (``rota-driver``): :class:`driver.publisher.SlicePublisher` publishes and
  reconciles the node's ResourceSlices (its own watch and resync), and
  :class:`driver.gc.LedgerCollector` passes over a ledger holding every claim of the node
  as prepared (:class:`LedgerSimulator`, in memory: no kubelet prepares anything here);
- lease controller (``rota-controller``): :class:`controller.lease.election.Election`
  renews the node's controller Lease; :class:`controller.lease.cache.NodeCache` keeps its
  watches (the node's pods, the claims they name, the node's slices and GPU Leases); per
  GPU a :class:`GpuEmulation`
  stands in for :class:`controller.lease.gpu.GpuWorker` and its
  :class:`controller.lease.switch.Switcher`: it reads and writes the GPU Lease through
  the real :class:`controller.lease.gpu.KubeLeasePort` and queues the visible state
  through the real :class:`controller.lease.visibility.GpuVisibility` and
  :class:`controller.lease.visible_state_writer.VisibleStateWriter`.

What :class:`GpuEmulation` reproduces of the worker, step by step (no engine and no GPU:
their calls are not API calls; each takes ``engine_s``):

- reconciliation (``reconcile_s`` besides its API calls: the engines asked whether they
  sleep, the GPU read): when the worker opens (a Lease read, then a write raising the
  fence, and one naming a holder when the Lease names none) and at least every
  ``resync_s``; the Lease is read from the API server only when the node's Lease watch has
  seen another version than the worker last wrote or read, as
  :meth:`controller.lease.gpu.GpuWorker.reconcile` does. The node's own visible-state
  writes that come back through its pod watch change no claimant, and so cause no
  reconciliation (:meth:`controller.lease.node.NodeController._follow_claimants`);
- a switch: both engine pods labelled ``switching``; the Lease written ``switching`` under
  a new fence (compare-and-swap); a fencing read before the holder's sleep and one before
  the target's wake; the Lease written naming the target; the ``SwitchedOut`` and
  ``SwitchedIn`` Events (series after the first); labels and conditions settled.

The lease controller's start-up admission, policy and engine calls are not emulated.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controller.claimants import DRIVER, Claimant
from controller.lease.cache import NodeCache
from controller.lease.election import Election
from controller.lease.gpu import KubeLeasePort, confirmed
from controller.lease.kube import ControllerKube
from controller.lease.settings import LeaseSettings
from controller.lease.switch import Fenced, Switcher, SwitchResult
from controller.lease.visibility import GpuVisibility
from controller.lease.visible_state_writer import VisibleStateKube, VisibleStateWriter
from driver.devices import GpuDevice
from driver.gc import LedgerCollector
from driver.ledger import ClaimRecord, LedgerState, PreparedDevice
from driver.publisher import SlicePublisher
from driver.settings import DriverSettings
from driver.slices import SharingMode
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.aio import wait_any
from rota.kit.errors import KubeError
from rota.kit.kube import ClientAgent, Kube, load_api_client

log = logging.getLogger(__name__)


def _default(model: Any, name: str) -> Any:
    return model.model_fields[name].default


ELECTION_LEASE_S = float(_default(LeaseSettings, "election_lease_s"))
RESYNC_S = float(_default(LeaseSettings, "resync_s"))
CONTROLLER_AGENT = ClientAgent(component="rota-controller",
                               qps=float(_default(LeaseSettings, "api_qps")),
                               burst=int(_default(LeaseSettings, "api_burst")))
DRIVER_AGENT = ClientAgent(component="rota-driver",
                           qps=float(_default(DriverSettings, "api_qps")),
                           burst=int(_default(DriverSettings, "api_burst")))
SLICE_RESYNC_S = float(_default(DriverSettings, "slice_resync_s"))


class LedgerSimulator:
    """The driver's ledger as :class:`driver.gc.LedgerCollector` reads it: every claim of
    the node prepared and completed; nothing is ever collected (they all stay held)."""

    def __init__(self) -> None:
        self.state = LedgerState(boot_id="scale-harness")

    def prepared(self, claimants: Sequence[Claimant], gpus: Sequence[GpuDevice]) -> None:
        uuids = {gpu.name: gpu.uuid for gpu in gpus}
        now = dt.datetime.now(dt.UTC)
        records = {}
        for c in claimants:
            uuid = uuids[c.gpu]
            records[c.claim_uid] = ClaimRecord(
                uid=c.claim_uid, namespace=c.namespace, name=c.claim_name,
                state="PrepareCompleted",
                devices=(PreparedDevice(request_names=("gpu",), pool_name=c.node,
                                        device_name=c.device, cdi_device_ids=(),
                                        gpu_uuid=uuid, resident_bytes=c.resident_bytes),),
                gpu_uuids=(uuid,), resident_bytes=c.resident_bytes,
                awake_bytes=c.resident_bytes, exclusive=False, prepared_at=now)
        self.state = LedgerState(boot_id="scale-harness", claims=records)

    def records(self) -> LedgerState:
        return self.state

    async def collect(self, uids: set[str], *, decided_at: float) -> list[str]:
        return []


class DriverEmulation:
    """One node's driver: slices and ledger GC (see the module docstring)."""

    def __init__(self, node: str, gpus: list[GpuDevice], *, kubeconfig: Path,
                 engines: int) -> None:
        self.node = node
        self.gpus = gpus
        kube = Kube(load_api_client(str(kubeconfig), agent=DRIVER_AGENT))
        self.publisher = SlicePublisher(kube=kube, node_name=node, gpus=gpus,
                                        mode=SharingMode.SHARED, engines=engines,
                                        resync_s=SLICE_RESYNC_S)
        self.ledger = LedgerSimulator()
        self.collector = LedgerCollector(preparer=self.ledger, kube=kube, node_name=node,
                                         driver=DRIVER, pool=node)
        self.prepared = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.publisher.run(stop), name=f"slices-{self.node}")
            if await wait_any(self.prepared, stop) and not stop.is_set():
                tasks.create_task(self.collector.run(stop), name=f"ledger-gc-{self.node}")


class GpuEmulation:
    """The API calls of one GPU worker (see the module docstring)."""

    def __init__(self, *, gpu: str, port: KubeLeasePort, claimants: list[Claimant],
                 visibility: GpuVisibility, identity: str, leading: asyncio.Event,
                 engine_s: float, reconcile_s: float = 0.0, resync_s: float = RESYNC_S,
                 lease_seen: Callable[[], str | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gpu = gpu
        self.lease_seen = lease_seen
        self.port = port
        self.claimants = claimants
        self.visibility = visibility
        self.identity = identity
        self.leading = leading
        self.engine_s = engine_s
        self.reconcile_s = reconcile_s
        self.resync_s = resync_s
        self.clock = clock
        self.lease: GpuLease | None = None
        self.queue: deque[Claimant] = deque()
        self.wakeup = asyncio.Event()
        self.dirty = True
        self.next_reconcile = 0.0
        self.switches = 0
        self.errors = 0
        self.reconciled = asyncio.Event()

    def mark_dirty(self) -> None:
        self.dirty = True
        self.wakeup.set()

    def request(self, target: Claimant) -> None:
        self.queue.append(target)
        self.wakeup.set()

    def other_than_holder(self, rng: random.Random) -> Claimant:
        holder = self.lease.holder if self.lease else ""
        return rng.choice([c for c in self.claimants if c.ref != holder] or self.claimants)

    async def run(self, stop: asyncio.Event) -> None:
        first = True
        while not stop.is_set():
            if not self.leading.is_set():
                # Not leading (yet, or any more): the worker is closed; a new term
                # reconciles first.
                if not await wait_any(self.leading, stop) or stop.is_set():
                    return
                first = True
            due = self.dirty or self.clock() >= self.next_reconcile
            if not (due or self.queue):
                await wait_any(self.wakeup, stop,
                               timeout_s=max(0.0, self.next_reconcile - self.clock()))
                self.wakeup.clear()
                continue
            try:
                if due:
                    await self.reconcile(first=first)
                    first = False
                if self.queue:
                    await self.switch(self.queue.popleft())
            except (KubeError, Fenced) as exc:
                self.errors += 1
                self.lease = None
                self.dirty = True
                log.warning("GPU step failed", extra={"device": self.gpu, "error": str(exc)})
                await wait_any(stop, timeout_s=1.0)

    async def reconcile(self, *, first: bool = False) -> None:
        self.dirty = False
        self.next_reconcile = self.clock() + self.resync_s
        lease = confirmed(self.lease, self.lease_seen()) or await self.port.read()
        await asyncio.sleep(self.reconcile_s)  # the engines asked, the GPU read
        if first:
            lease = await self.port.write(lease.new_term(self.identity))
            if lease.state != naming.STATE_AWAKE and self.claimants:
                lease = await self.port.write(Switcher.serving(lease, self.claimants[0],
                                                               controller=self.identity))
        self.lease = lease
        self.visibility.settled(self.claimants, lease)
        self.reconciled.set()

    async def _fence(self, fence: int) -> None:
        current = await self.port.read()
        if current.fence != fence:
            raise Fenced(f"fence {fence} is stale: {current.fence}")

    async def switch(self, target: Claimant) -> None:
        lease = self.lease if self.lease is not None else await self.port.read()
        holder = next((c for c in self.claimants if c.ref == lease.holder), None)
        if holder is target:
            return
        self.visibility.switching(holder, target)
        lease = await self.port.write(lease.opening(
            naming.LeaseState.SWITCHING, controller=self.identity, target_model=target.model,
            draining_model=holder.model if holder else ""))
        self.lease = lease
        await self._fence(lease.fence)  # before the holder's sleep
        await asyncio.sleep(self.engine_s)
        await self._fence(lease.fence)  # before the target's wake
        await asyncio.sleep(self.engine_s)
        lease = self.lease = await self.port.write(Switcher.serving(lease, target))
        self.visibility.switched(SwitchResult(True, lease), holder, target)
        self.visibility.settled(self.claimants, lease)
        self.switches += 1


class ControllerEmulation:
    """One node's lease controller (see the module docstring)."""

    def __init__(self, node: str, *, kubeconfig: Path, namespace: str,
                 engine_s: float, reconcile_s: float) -> None:
        self.node = node
        self.namespace = namespace
        self.engine_s = engine_s
        self.reconcile_s = reconcile_s
        api = load_api_client(str(kubeconfig), agent=CONTROLLER_AGENT)
        self.kube = ControllerKube(api)
        self.identity = f"{node}-controller"
        # The real controller's election has a client (and token bucket) of its own.
        election_kube = ControllerKube(load_api_client(str(kubeconfig),
                                                       agent=CONTROLLER_AGENT))
        self.election = Election(kube=election_kube, namespace=namespace, node=node,
                                 identity=self.identity, duration_s=ELECTION_LEASE_S,
                                 activation_url="http://127.0.0.1:9/")
        self.cache = NodeCache(api, node=node, lease_namespace=namespace)
        self.writer = VisibleStateWriter(VisibleStateKube(api), instance=self.election.instance)
        self.gpus: dict[str, GpuEmulation] = {}

    def follow(self, claimants: Sequence[Claimant]) -> None:
        by_gpu: dict[str, list[Claimant]] = {}
        for c in claimants:
            by_gpu.setdefault(c.gpu, []).append(c)
        for gpu, on_gpu in sorted(by_gpu.items()):
            port = KubeLeasePort(self.kube, self.namespace, self.node, gpu)
            self.gpus[gpu] = GpuEmulation(
                gpu=gpu, port=port,
                lease_seen=functools.partial(self.cache.lease_version, port.name),
                claimants=on_gpu, visibility=GpuVisibility(self.writer, gpu),
                identity=self.identity, leading=self.election.acquired,
                engine_s=self.engine_s, reconcile_s=self.reconcile_s)

    async def ready(self) -> None:
        """Until the watches listed, the Lease is held, every GPU reconciled once and the
        visible state of every engine written (what a controller does when it starts)."""
        await self.cache.wait_synced()
        await self.election.acquired.wait()
        for gpu in self.gpus.values():
            await gpu.reconciled.wait()
        await self.writer.idle.wait()

    async def run(self, stop: asyncio.Event) -> None:
        self.cache.start()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.election.run(stop), name=f"election-{self.node}")
                tasks.create_task(self.writer.run(stop), name=f"visible-{self.node}")
                for gpu in self.gpus.values():
                    tasks.create_task(gpu.run(stop), name=f"gpu-{self.node}-{gpu.gpu}")
        finally:
            await self.cache.stop()


async def drive_switches(gpus: Sequence[GpuEmulation], *, per_gpu_hour: float,
                         stop: asyncio.Event, rng: random.Random) -> None:
    """Ask for switches at ``per_gpu_hour`` per GPU on average (Poisson arrivals), each
    on a GPU chosen at random, for a claimant other than its holder."""
    rate = per_gpu_hour * len(gpus) / 3600.0
    if rate <= 0 or not gpus:
        await stop.wait()
        return
    while not await wait_any(stop, timeout_s=rng.expovariate(rate)):
        gpu = rng.choice(gpus)
        gpu.request(gpu.other_than_holder(rng))

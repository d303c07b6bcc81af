"""The lease controller of one node: claimants, one worker per GPU, reconciliation.

It acts only while it holds the node's controller Lease. Each time it (re)gains it, and at
every resync, it reconciles before serving anything: every claimant is asked whether it
sleeps, and all but one awake engine per GPU are put to sleep (see
:mod:`controller.reconcile`). A holder whose pod is gone is struck from its Lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from controller import metrics, naming, reconcile
from controller.claimants import Claimant, claimants_from
from controller.device import DeviceReader, GpuSnapshot
from controller.election import Election
from controller.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.engines.errors import EngineError
from controller.engines.registry import make_adapter
from controller.gpu import Activation, GpuWorker, KubeLeasePort
from controller.kube import ControllerKube
from controller.settings import LeaseSettings
from controller.switch import Fenced, Limits, Ports, Switcher
from driver.aio import wait_any
from driver.errors import KubeError

log = logging.getLogger(__name__)


class UnknownModel(LookupError):
    """No serving claimant on this node has that model (or claim)."""


class NodeController:
    def __init__(self, *, settings: LeaseSettings, kube: ControllerKube, election: Election,
                 device: DeviceReader, session: aiohttp.ClientSession,
                 engine_token: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.kube = kube
        self.election = election
        self.device = device
        self.session = session
        self.engine_token = engine_token
        self.clock = clock
        self.engine_timeouts = Timeouts(
            sleep_s=settings.timeouts.sleep_s, wake_level1_s=settings.timeouts.wake_s,
            wake_level2_s=settings.timeouts.wake_s, probe_total_s=settings.timeouts.probe_s)
        self.workers: dict[str, GpuWorker] = {}
        self._claimants: list[Claimant] = []
        self._claimants_at = 0.0
        self._refresh_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.reconciled = asyncio.Event()

    # -- claimants and engines --------------------------------------------------------------

    async def claimants(self, *, max_age_s: float = 0.5) -> list[Claimant]:
        """Claimants on this node, re-read from the API when older than ``max_age_s``."""
        async with self._refresh_lock:
            if self.clock() - self._claimants_at > max_age_s:
                claims = await self.kube.list_claims()
                pods = {p["metadata"]["uid"]: p for p in
                        await self.kube.list_pods(node=self.settings.node_name)}
                self._claimants = claimants_from(claims, pods, node=self.settings.node_name)
                self._claimants_at = self.clock()
            return list(self._claimants)

    def engine(self, claimant: Claimant) -> EngineAdapter:
        if claimant.endpoint is None:
            raise Fenced(f"{claimant.ref} has no pod IP")
        endpoint = EngineEndpoint(base_url=claimant.endpoint, model=claimant.model,
                                  claim=claimant.ref,
                                  pod=f"{claimant.namespace}/{claimant.pod_name}",
                                  token=self.engine_token)
        return make_adapter(claimant.config, endpoint, self.session, self.engine_timeouts)

    def _guard(self) -> None:
        if not self.election.is_leader():
            raise Fenced(f"{self.election.identity} no longer leads node "
                         f"{self.settings.node_name}")

    async def _snapshot(self, device: str) -> GpuSnapshot:
        snapshots = await self.device.read()
        for snap in snapshots.values():
            for proc in snap.processes:
                metrics.GPU_PROCESS_MEMORY.labels(snap.device, str(proc.pid),
                                                  proc.claim_uid or "unknown").set(proc.used_bytes)
        if device not in snapshots:
            raise LookupError(f"no GPU {device} on node {self.settings.node_name}")
        return snapshots[device]

    def _worker(self, device: str) -> GpuWorker:
        worker = self.workers.get(device)
        if worker is None:
            s = self.settings
            lease_port = KubeLeasePort(self.kube, s.namespace, s.node_name, device)
            snapshot = self._snapshot

            class _Device:
                async def snapshot(self, device: str) -> GpuSnapshot:
                    return await snapshot(device)

            switcher = Switcher(
                ports=Ports(lease=lease_port, device=_Device(), engine=self.engine,
                            guard=self._guard, clock=self.clock),
                limits=Limits(tolerance_bytes=s.resident_tolerance_bytes,
                              unknown_limit_bytes=s.unknown_process_bytes,
                              timeouts=s.timeouts),
                identity=s.identity)
            worker = GpuWorker(device=device, lease_port=lease_port, switcher=switcher,
                               claimants=self.claimants, engine=self.engine,
                               min_residency_s=s.min_residency_s, idle_sleep_s=s.idle_sleep_s,
                               clock=self.clock, coalesce_window_s=s.coalesce_window_s)
            self.workers[device] = worker
            if self._stop is not None:
                task = asyncio.create_task(worker.run(self._stop, poll_s=s.resync_s),
                                           name=f"gpu-{device}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return worker

    # -- activation ----------------------------------------------------------------------------

    async def activate(self, model: str, claim: str | None = None) -> Activation:
        if not self.election.is_leader():
            raise Fenced(f"this instance does not act for node {self.settings.node_name}")
        await wait_any(self.reconciled, timeout_s=self.settings.timeouts.lease_s)
        current = await self.claimants(max_age_s=0.5)
        matching = [c for c in current if c.model == model and (claim is None or c.ref == claim)
                    and c.serving]
        if not matching:
            raise UnknownModel(f"no serving claimant for model {model!r} on node "
                               f"{self.settings.node_name}")
        holders = {w.lease.holder for w in self.workers.values() if w.lease}
        target = next((c for c in matching if c.ref in holders), matching[0])
        return await self._worker(target.device).activate(target)

    # -- reconciliation --------------------------------------------------------------------------

    async def _sleeping(self, claimant: Claimant) -> bool | None:
        try:
            return await self.engine(claimant).is_sleeping()
        except (EngineError, Fenced, TimeoutError) as exc:
            log.warning("claimant did not say whether it sleeps",
                        extra={"claim": claimant.ref, "error": str(exc)})
            return None

    async def reconcile(self) -> None:
        """At most one awake engine per GPU, and Leases that say who it is."""
        current = [c for c in await self.claimants(max_age_s=0) if c.serving]
        devices = sorted({c.device for c in current} | set(self.workers))
        for device in devices:
            worker = self._worker(device)
            async with worker.lock:
                await self._reconcile_device(worker, [c for c in current if c.device == device])
        self.reconciled.set()

    async def _reconcile_device(self, worker: GpuWorker, on_gpu: list[Claimant]) -> None:
        device = worker.device
        lease = await worker.lease_port.read()
        if lease.state == naming.STATE_SWITCHING:
            # Nobody switches while this worker's lock is held: a switch was cut short by
            # the crash (or the loss of leadership) of the instance that ran it.
            metrics.FAILURES.labels("controller_crash").inc()
            log.warning("found a switch its controller never finished",
                        extra={"device": device, "fence": lease.fence,
                               "controller": lease.controller or None,
                               "target": lease.target_model or None})
        states = dict(zip([c.claim_uid for c in on_gpu],
                          await asyncio.gather(*(self._sleeping(c) for c in on_gpu)),
                          strict=True))
        decision = reconcile.plan(on_gpu, states, lease.holder)
        for extra in decision.put_to_sleep:
            self._guard()
            log.warning("two engines awake; putting the non-holder to sleep",
                        extra={"device": device, "claim": extra.ref,
                               "keep": decision.keep.ref if decision.keep else None})
            try:
                outcome = await self.engine(extra).sleep(extra.sleep_level)
                worker.switcher.record_sleep(extra, outcome.sleep_s)
                metrics.RECONCILES.labels("two_awake").inc()
            except EngineError as exc:
                log.error("could not put an extra awake engine to sleep",
                          extra={"claim": extra.ref, "error": str(exc)})
        keep = decision.keep
        wanted = (keep.ref if keep else "",
                  naming.STATE_AWAKE if keep else naming.STATE_IDLE)
        if (lease.holder, lease.state) != wanted or (
                keep and lease.holder_endpoint != (keep.endpoint or "")):
            self._guard()
            # A new fencing number: whatever an earlier instance was doing is over.
            lease = lease.with_(fence=lease.fence + 1)
            if keep:
                lease = lease.with_(holder=keep.ref, holder_model=keep.model,
                                    holder_claim_uid=keep.claim_uid,
                                    holder_endpoint=keep.endpoint or "",
                                    state=naming.STATE_AWAKE, target_model="",
                                    draining_model="", controller=self.settings.identity)
            else:
                lease = lease.with_(holder="", holder_model="", holder_claim_uid="",
                                    holder_endpoint="", state=naming.STATE_IDLE,
                                    target_model="", draining_model="",
                                    controller=self.settings.identity)
            worker.lease = await worker.lease_port.write(lease)
            log.info("lease reconciled", extra={"device": device, "holder": wanted[0],
                                                "state": wanted[1]})
        else:
            worker.lease = lease
        for claimant in on_gpu:
            metrics.HOLDER.labels(device, claimant.ref).set(
                1 if keep and claimant.claim_uid == keep.claim_uid else 0)

    # -- the loop ----------------------------------------------------------------------------------

    _stop: asyncio.Event | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        try:
            while not stop.is_set():
                if not await wait_any(self.election.acquired, stop):
                    continue
                if stop.is_set():
                    break
                metrics.LEADER.set(1)
                self.reconciled.clear()
                while self.election.acquired.is_set() and not stop.is_set():
                    if not any(w.pending() for w in self.workers.values()):
                        try:
                            await self.reconcile()
                        except (KubeError, Fenced, OSError, LookupError) as exc:
                            log.warning("reconciliation failed; retrying",
                                        extra={"error": str(exc)})
                    await wait_any(self.election.lost, stop, timeout_s=self.settings.resync_s)
                metrics.LEADER.set(0)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

"""The lease controller of one node: claimants, one worker per physical GPU, leadership.

It acts only while it holds the node's controller Lease. Each time it gains the Lease,
every GPU worker opens and reconciles before serving anything (see :mod:`controller.lease.gpu`);
when it loses the Lease, every worker closes at once: waiters are answered, no new engine
call is made, and a step in flight stops at its next fencing check.

Workers, GPU Leases and reconciliation are keyed by the physical GPU
(:attr:`controller.claimants.Claimant.gpu`): in ``partitioned`` mode every share of a GPU
(``gpu-0-share-<k>``) belongs to the one worker of ``gpu-0``. A claimant that holds several
GPUs has a worker on each; the workers of GPUs joined by such claimants take each other's
locks for every step (:mod:`controller.lease.gpu_locks`).

Each engine is sent its own claim's control token and no other
(:mod:`controller.lease.control_tokens`, asked of the node's driver): an engine listens at
an address its tenant chooses, so a credential sent there must open nothing else.

Stopping (:meth:`NodeController.drain`): workers close and answer their waiters, the step
in flight finishes within the grace period, and only then may the Lease be released.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from controller.claimants import Claimant, gpu_order
from controller.lease import metrics
from controller.lease.admission import StartLimits, StartSwitch
from controller.lease.cache import NodeCache
from controller.lease.control_tokens import ControlTokens
from controller.lease.device import DeviceReader, FootprintWatch, GpuSnapshot
from controller.lease.election import Election
from controller.lease.engines import dialect
from controller.lease.engines.base import EngineAdapter, EngineEndpoint
from controller.lease.engines.no_address import NoAddressEngine
from controller.lease.engines.registry import make_adapter
from controller.lease.errors import LeaseControllerError
from controller.lease.gpu import Activation, GpuWorker, KubeLeasePort, Policy
from controller.lease.gpu_locks import GpuLocks, domains
from controller.lease.kube import ControllerKube
from controller.lease.settings import LeaseSettings
from controller.lease.switch import Fenced, Limits, Ports, Switcher
from controller.lease.visibility import GpuVisibility
from controller.lease.visible_state_writer import VisibleStateWriter
from rota.kit.aio import wait_any

log = logging.getLogger(__name__)

MEMORY = metrics.SeriesSet(metrics.GPU_MEMORY)


def engine_run(claimant: Claimant) -> str | None:
    """Which run of the claimant's engine this is (pod uid, container restarts); None
    while it has no pod. What adapters learn about an engine is kept per run."""
    if claimant.pod_uid is None:
        return None
    return f"{claimant.pod_uid}/{claimant.restarts}"


@dataclass(frozen=True)
class StartAnswer:
    granted: bool = False
    status: int = 200
    reason: str = ""
    message: str = ""
    retry_after_s: float = 0.0


class UnknownModel(LeaseControllerError, LookupError):
    """No serving claimant on this node has that model (or claim)."""


class NodeController:
    def __init__(self, *, settings: LeaseSettings, kube: ControllerKube, election: Election,
                 device: DeviceReader, session: aiohttp.ClientSession, cache: NodeCache,
                 clock: Callable[[], float] = time.monotonic,
                 visible: VisibleStateWriter | None = None) -> None:
        self.settings = settings
        self.kube = kube
        self.election = election
        self.device = device
        self.session = session
        self.cache = cache
        self.control_tokens = ControlTokens(self._ask_control_token)
        self.clock = clock
        self.visible = visible
        self.engine_timeouts = settings.timeouts.engine_calls()
        self.workers: dict[str, GpuWorker] = {}
        self.locks = GpuLocks()
        self._domains: dict[str, tuple[str, ...]] = {}
        self._followed: dict[str, tuple[Claimant, ...]] = {}
        """The claimants of each GPU as its worker was last told of them."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._workers_stop = asyncio.Event()
        self._leading = False
        self._stopping = False

    # -- claimants and engines --------------------------------------------------------------

    def claimants(self) -> list[Claimant]:
        """Claimants on this node, from the watch-fed cache."""
        return self.cache.claimants()

    def engine(self, claimant: Claimant) -> EngineAdapter:
        # 0.0.0.0: no address yet; a NoAddressEngine never sends anything there.
        endpoint = EngineEndpoint(base_url=claimant.endpoint or f"http://0.0.0.0:{claimant.port}",
                                  model=claimant.model,
                                  claim=claimant.ref,
                                  pod=f"{claimant.namespace}/{claimant.pod_name}",
                                  token_source=self.control_tokens.source(claimant.claim_uid),
                                  run=engine_run(claimant))
        if claimant.endpoint is None:
            return NoAddressEngine(endpoint)
        return make_adapter(claimant.config, endpoint, self.session, self.engine_timeouts)

    async def _ask_control_token(self, claim_uid: str) -> str:
        return await self.device.control_token(claim_uid)

    def _guard(self) -> None:
        if not self.election.is_leader():
            raise Fenced(f"{self.election.identity} no longer leads node "
                         f"{self.settings.node_name}")

    async def snapshot(self, gpu: str) -> GpuSnapshot:
        """One GPU read through the driver's inspection API (and its memory metrics)."""
        snapshots = await self.device.read()
        for snap in snapshots.values():
            held: dict[tuple[str, ...], float] = {}
            for proc in snap.processes:
                key = (snap.device, snap.uuid, proc.claim_uid or "unknown")
                held[key] = held.get(key, 0.0) + proc.used_bytes
            MEMORY.set(snap.device, held)
        if gpu not in snapshots:
            raise LookupError(f"no GPU {gpu} on node {self.settings.node_name}")
        return snapshots[gpu]

    def _worker(self, gpu: str) -> GpuWorker:
        worker = self.workers.get(gpu)
        if worker is None:
            s = self.settings
            lease_port = KubeLeasePort(self.kube, s.namespace, s.node_name, gpu)
            snapshot = self.snapshot

            class _Device:
                async def snapshot(self, device: str) -> GpuSnapshot:
                    return await snapshot(device)

            visibility = GpuVisibility(self.visible, gpu) if self.visible else None
            footprint = FootprintWatch(
                fraction=s.footprint_warn_fraction,
                notify=visibility.footprint_creeping if visibility else None)
            switcher = Switcher(
                ports=Ports(lease=lease_port, device=_Device(), engine=self.engine,
                            guard=self._guard, clock=self.clock, footprint=footprint),
                limits=Limits(tolerance_bytes=s.resident_tolerance_bytes,
                              unknown_limit_bytes=s.unknown_process_bytes,
                              timeouts=s.timeouts),
                identity=s.identity)
            starter = StartSwitch(switcher, claimant_of=self.cache.claimant,
                                  limits=StartLimits(start_s=s.timeouts.start_s,
                                                     grant_s=s.start_hold_s + 10.0))
            worker = GpuWorker(
                gpu=gpu, lease_port=lease_port, switcher=switcher, claimants=self.claimants,
                engine=self.engine, clock=self.clock, identity=s.identity, starter=starter,
                locks=self.locks, domain=functools.partial(self._domain_of, gpu),
                sibling=self._worker,
                lease_seen=functools.partial(self.cache.lease_version, lease_port.name),
                visibility=visibility,
                policy=Policy(min_residency_s=s.min_residency_s, idle_sleep_s=s.idle_sleep_s,
                              coalesce_window_s=s.coalesce_window_s, resync_s=s.resync_s,
                              tolerance_bytes=s.resident_tolerance_bytes,
                              models=s.model_policy(), home_model=s.home_model,
                              home_idle_s=s.home_idle_s,
                              priority_ceilings=s.policy_priority_ceilings.root,
                              awake_set=s.awake_set_on(gpu)))
            self.workers[gpu] = worker
            self._tasks[gpu] = asyncio.create_task(worker.run(self._workers_stop),
                                                   name=f"gpu-{gpu}")
            if self._leading:
                worker.open()
        return worker

    def _domain_of(self, gpu: str) -> tuple[str, ...]:
        return self._domains.get(gpu, (gpu,))

    def _follow_claimants(self, *, every_gpu: bool = False) -> None:
        """A worker for every GPU with claimants; a worker reconciles when the claimants of
        its GPU changed (``every_gpu``: all of them, as a new term begins). A change the
        controller's own writes echo back (a pod's state label) changes no claimant and
        costs no reconciliation."""
        claimants = self.claimants()
        self.control_tokens.keep_only({c.claim_uid for c in claimants})
        dialect.keep_only({engine_run(c) for c in claimants})
        self._domains = domains(claimants)
        for gpu in sorted({g for c in claimants for g in c.gpus}, key=gpu_order):
            self._worker(gpu)
        if self.visible is not None:
            self.visible.forget(pod_uids={c.pod_uid for c in claimants if c.pod_uid},
                                claim_uids={c.claim_uid for c in claimants})
        for gpu, worker in self.workers.items():
            on_gpu = tuple(c for c in claimants if gpu in c.gpus)
            if every_gpu or self._followed.get(gpu) != on_gpu:
                self._followed[gpu] = on_gpu
                worker.mark_dirty()

    # -- activation ----------------------------------------------------------------------------

    async def activate(self, model: str, claim: str | None = None) -> Activation:
        if self._stopping:
            raise Fenced(f"the controller of node {self.settings.node_name} is stopping")
        if not self.election.is_leader() or not self._leading:
            raise Fenced(f"this instance does not act for node {self.settings.node_name}")
        matching = [c for c in self.claimants() if c.model == model
                    and (claim is None or c.ref == claim) and c.serving]
        if not matching:
            raise UnknownModel(f"no serving claimant for model {model!r} on node "
                               f"{self.settings.node_name}")
        holders = {w.lease.holder for w in self.workers.values() if w.lease}
        target = next((c for c in matching if c.ref in holders), matching[0])
        return await self._worker(target.gpu).activate(target)

    async def request_start(self, claim_uid: str, token: str) -> StartAnswer:
        """One long poll of a start gate (see :mod:`controller.lease.starts`)."""
        hold = self.settings.start_hold_s
        if not await self.device.verify_start_token(claim_uid, token):
            return StartAnswer(status=401, reason="unauthorized",
                               message="the start token is not this claim's")
        if self._stopping or not self._leading or not self.election.is_leader():
            return StartAnswer(reason="not_leader", retry_after_s=1.0,
                               message="this instance does not act for the node now")
        present = await self.cache.wait_for(lambda: self.cache.claimant(claim_uid) is not None,
                                            timeout_s=min(hold, 5.0))
        claimant = self.cache.claimant(claim_uid)
        if not present or claimant is None:
            return StartAnswer(reason="unknown_claim", retry_after_s=1.0,
                               message=f"no claimant with claim uid {claim_uid} on node "
                                       f"{self.settings.node_name} (yet)")
        if await self._worker(claimant.gpu).request_start(claimant, hold_s=hold):
            return StartAnswer(granted=True)
        return StartAnswer(reason="waiting", retry_after_s=0.0,
                           message="another engine holds the GPU; ask again")

    @property
    def reconciled(self) -> bool:
        """Leading, and every worker has reconciled since it opened."""
        return self._leading and all(w.lease is not None for w in self.workers.values())

    # -- the loop ----------------------------------------------------------------------------------

    async def _follow_cache(self, stop: asyncio.Event) -> None:
        seen = -1
        while not stop.is_set():
            if self.cache.version != seen:
                seen = self.cache.version
                self._follow_claimants()
            await self.cache.wait_for(functools.partial(self._moved_on, seen, stop),
                                      timeout_s=self.settings.resync_s)

    def _moved_on(self, seen: int, stop: asyncio.Event) -> bool:
        return self.cache.version != seen or stop.is_set()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow leadership until ``stop``; the workers keep running until :meth:`drain`."""
        await wait_any(self.cache.synced, stop)
        follower = asyncio.create_task(self._follow_cache(stop), name="follow-claimants")
        try:
            while not stop.is_set():
                if not await wait_any(self.election.acquired, stop) or stop.is_set():
                    continue
                metrics.LEADER.set(1)
                self._follow_claimants(every_gpu=True)
                self._leading = True
                for worker in self.workers.values():
                    worker.open()
                await wait_any(self.election.lost, stop)
                self._leading = False
                metrics.LEADER.set(0)
                if not stop.is_set():
                    log.warning("lost the node; every worker stops taking work",
                                extra={"node": self.settings.node_name})
                    for worker in self.workers.values():
                        worker.close("not_leader", "this instance no longer acts for node "
                                     f"{self.settings.node_name}")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking work, answer every waiter, and let the steps in flight finish
        within ``grace_s``; then end the workers. True when nothing was cut short (the
        controller Lease may be released); False when a step had to be cancelled."""
        self._stopping = True
        self._leading = False
        for worker in self.workers.values():
            worker.close("stopping", f"the controller of node {self.settings.node_name} is "
                         "stopping")
        self._workers_stop.set()
        tasks = list(self._tasks.values())
        if not tasks:
            return True
        _done, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            log.error("a step was still running at the end of the grace period; cutting it "
                      "short", extra={"node": self.settings.node_name, "task": task.get_name()})
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        metrics.LEADER.set(0)
        return not pending

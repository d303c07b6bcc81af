"""One worker per shared GPU: the activation queue, the policy, and the switches.

Activations are queued per GPU and served one switch at a time. Every caller waiting for
the same claimant shares one switch (coalescing), and claimants are served in the order
their first request arrived. Policy against thrash: the holder keeps the GPU for at least
``min_residency_s`` before a switch away (its requests keep flowing meanwhile), and an
optional idle TTL puts a holder without work to sleep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from controller import naming
from controller.claimants import Claimant
from controller.engines.base import EngineAdapter
from controller.engines.errors import EngineError
from controller.kube import ControllerKube
from controller.leases import GpuLease, lease_body
from controller.switch import Fenced, Switcher, SwitchResult
from driver.aio import wait_any
from driver.errors import KubeConflictError, KubeNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Activation:
    ok: bool
    claimant: Claimant
    switched: bool
    fence: int
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)


class KubeLeasePort:
    """The GPU Lease of one device, read and written with compare-and-swap."""

    def __init__(self, kube: ControllerKube, namespace: str, node: str, device: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.device = device
        self.name = naming.gpu_lease_name(node, device)

    async def read(self) -> GpuLease:
        try:
            return GpuLease.from_object(await self.kube.get_lease(self.namespace, self.name))
        except KubeNotFoundError:
            fresh = GpuLease(name=self.name, node=self.node, device=self.device)
            body = lease_body(fresh, self.namespace, labels_node=self.node,
                              labels_device=self.device)
            try:
                return GpuLease.from_object(await self.kube.create_lease(self.namespace, body))
            except KubeConflictError:
                return GpuLease.from_object(await self.kube.get_lease(self.namespace,
                                                                      self.name))

    async def write(self, lease: GpuLease) -> GpuLease:
        body = lease_body(lease, self.namespace, labels_node=self.node,
                          labels_device=self.device)
        try:
            return GpuLease.from_object(await self.kube.replace_lease(self.namespace, body))
        except KubeConflictError as exc:
            raise Fenced(f"GPU lease {self.name} changed under this switch: {exc}") from exc


@dataclass
class _Waiting:
    claimant: Claimant
    futures: list[asyncio.Future[Activation]]


class GpuWorker:
    def __init__(self, *, device: str, lease_port: KubeLeasePort, switcher: Switcher,
                 claimants: Callable[[], Awaitable[list[Claimant]]],
                 engine: Callable[[Claimant], EngineAdapter], min_residency_s: float,
                 idle_sleep_s: float, clock: Callable[[], float],
                 coalesce_window_s: float = 0.0) -> None:
        self.device = device
        self.lease_port = lease_port
        self.switcher = switcher
        self.claimants = claimants
        self.engine = engine
        self.min_residency_s = min_residency_s
        self.coalesce_window_s = coalesce_window_s
        self.idle_sleep_s = idle_sleep_s
        self.clock = clock
        self.lease: GpuLease | None = None
        self.last_switch: dict[str, object] = {}
        """Outcome and timings of the latest switch, for /v1/state."""
        self._queue: dict[str, _Waiting] = {}
        self._wakeup = asyncio.Event()
        self._switching = False
        self.lock = asyncio.Lock()
        """Held by every switch and by reconciliation of this GPU: one actor at a time."""
        self._holder_since = clock()
        self._last_busy = clock()

    # -- callers ---------------------------------------------------------------------------

    async def activate(self, claimant: Claimant) -> Activation:
        lease = self.lease
        if (lease is not None and lease.holder == claimant.ref
                and lease.state == naming.STATE_AWAKE and not self._switching):
            # The holder serves now, even while a switch away waits for its residency.
            return Activation(True, claimant, switched=False, fence=lease.fence)
        future: asyncio.Future[Activation] = asyncio.get_running_loop().create_future()
        self._queue.setdefault(claimant.claim_uid, _Waiting(claimant, [])).futures.append(future)
        self._wakeup.set()
        return await future

    def pending(self) -> int:
        return sum(len(w.futures) for w in self._queue.values())

    # -- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, poll_s: float) -> None:
        while not stop.is_set():
            if not self._queue:
                await wait_any(self._wakeup, stop, timeout_s=poll_s)
                self._wakeup.clear()
            if stop.is_set():
                break
            try:
                async with self.lock:
                    if self._queue:
                        await self._serve_next(stop)
                    elif self.idle_sleep_s > 0:
                        await self._idle_check()
            except Fenced as exc:
                log.warning("switch fenced off; another writer moved the lease",
                            extra={"device": self.device, "error": str(exc)})
                self._fail_all("fenced", str(exc))
                self.lease = None
            except Exception as exc:
                log.exception("GPU worker step failed", extra={"device": self.device})
                self._fail_all(type(exc).__name__.lower(), str(exc))
        self._fail_all("stopping", "the controller is stopping")

    def _fail_all(self, reason: str, message: str) -> None:
        for waiting in self._queue.values():
            for future in waiting.futures:
                if not future.done():
                    future.set_result(Activation(False, waiting.claimant, switched=False,
                                                 fence=self.lease.fence if self.lease else 0,
                                                 reason=reason, message=message))
        self._queue.clear()

    async def _serve_next(self, stop: asyncio.Event) -> None:
        uid = next(iter(self._queue))
        current = await self.claimants()
        by_uid = {c.claim_uid: c for c in current}
        target = by_uid.get(uid)
        waiting = self._queue[uid]
        if target is None or not target.serving:
            self._queue.pop(uid)
            self._resolve(waiting, Activation(False, waiting.claimant, False, 0,
                                              "not_serving", f"{waiting.claimant.ref} has no "
                                              "running, ready pod on this node"))
            return
        lease = self.lease = await self.lease_port.read()
        holder = next((c for c in current if c.ref == lease.holder), None)
        if holder is not None and holder.claim_uid == uid and lease.state == naming.STATE_AWAKE:
            self._queue.pop(uid)
            self._resolve(waiting, Activation(True, target, False, lease.fence))
            return
        if holder is not None and lease.state == naming.STATE_AWAKE:
            remaining = self._holder_since + self.min_residency_s - self.clock()
            if remaining > 0:
                log.info("holding the switch for minimum residency", extra={
                    "device": self.device, "holder": holder.ref, "wait_s": round(remaining, 3)})
                if await wait_any(stop, timeout_s=remaining):
                    return
            if self.coalesce_window_s > 0 and await self._coalesce(holder, stop):
                return
        self._queue.pop(uid)
        on_gpu = [c for c in current if c.device == self.device and c.node == target.node]
        self._switching = True
        try:
            result: SwitchResult = await self.switcher.switch(
                lease, holder=holder if lease.state != naming.STATE_IDLE else None,
                target=target, claimants=on_gpu)
        finally:
            self._switching = False
        self.lease = result.lease
        self.last_switch = {"ok": result.ok, "from": holder.ref if holder else None,
                            "to": target.ref, "reason": result.reason,
                            "fence": result.lease.fence,
                            "timings": {k: round(v, 6) for k, v in result.timings.items()}}
        if result.lease.holder != (holder.ref if holder else ""):
            self._holder_since = self.clock()
            self._last_busy = self.clock()
        self._resolve(waiting, Activation(result.ok, target, switched=result.ok,
                                          fence=result.lease.fence, reason=result.reason,
                                          message=result.message, timings=result.timings))

    async def _coalesce(self, holder: Claimant, stop: asyncio.Event) -> bool:
        """Let the holder finish what it is serving (up to the window) before its
        admission closes; True when the controller is stopping."""
        deadline = self.clock() + self.coalesce_window_s
        delay = 0.01
        engine = self.engine(holder)
        while self.clock() < deadline:
            try:
                if not await engine.in_flight():
                    return False
            except EngineError as exc:  # the drain step will find out what is going on
                log.info("holder's load unknown; not waiting for it",
                         extra={"device": self.device, "error": str(exc)})
                return False
            if await wait_any(stop, timeout_s=min(delay, max(0.0, deadline - self.clock()))):
                return True
            delay = min(delay * 2, 0.25)
        log.info("coalescing window over; switching with work in flight",
                 extra={"device": self.device, "holder": holder.ref})
        return False

    @staticmethod
    def _resolve(waiting: _Waiting, activation: Activation) -> None:
        for future in waiting.futures:
            if not future.done():
                future.set_result(activation)

    async def _idle_check(self) -> None:
        lease = self.lease = await self.lease_port.read()
        if not lease.holder or lease.state != naming.STATE_AWAKE:
            return
        holder = next((c for c in await self.claimants() if c.ref == lease.holder), None)
        if holder is None:
            return
        try:
            busy = await self.engine(holder).in_flight()
        except EngineError as exc:
            log.info("holder's load unknown; not putting it to sleep",
                     extra={"device": self.device, "error": str(exc)})
            return
        if busy:
            self._last_busy = self.clock()
            return
        if self.clock() - self._last_busy >= self.idle_sleep_s:
            self._switching = True
            try:
                self.lease = await self.switcher.sleep_holder(lease, holder, reason="idle")
            finally:
                self._switching = False

"""Leadership per node: the controller instance that may act on this node's GPUs.

One Lease per node (:class:`rota.api.controller_lease.ControllerLease`) names the
acting instance. An instance acquires it when it is free or expired, renews it every third
of its duration, and considers itself leader only until a local deadline (``asked at +
duration * 2/3``, measured on the monotonic clock from when it *asked* for the renewal) so
that an instance cut off from the API server stops acting before anyone else may start.

Another instance's Lease is expired by the observer's rule
(:class:`~rota.api.controller_lease.LeaseObserver`): when this instance has not
seen the record change for the Lease's duration, on this instance's own monotonic clock.
The holder's ``renewTime`` was stamped by its wall clock and is never compared with this
one's, so a skewed or stepped wall clock on either side neither lets a standby take over
from a holder that still renews nor delays it. A standby that starts counts the Lease it
first sees as renewed then: it waits one whole duration before taking over from a holder
that died before it started.

The holder renews on client-go's fast path: it writes over the Lease it last wrote, whose
``resourceVersion`` makes the write a compare-and-swap, and reads the Lease only when that
write conflicts (someone else wrote in between) or fails: one UPDATE per renewal, no GET.

Losing the Lease sets :attr:`Election.lost`: the node controller stops taking work at once
and every switch stops at its next fencing check (the call in flight is not cancelled: a
wake cannot be called back from an engine).

Each process writes a fresh instance id next to its identity. A restarted process with the
same identity (a container restart keeps the pod name) is therefore *not* the holder: it
waits for the Lease to expire like any other instance, so that calls its predecessor sent
have landed or timed out before it acts. An instance that stops cleanly releases the
Lease, and its successor acquires it at once; one that stops with a step still in flight
(:attr:`Election.keep_on_exit`) leaves it to expire.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from controller.lease.kube import ControllerKube
from rota.api import naming
from rota.api.controller_lease import ControllerLease, LeaseObserver
from rota.kit.errors import KubeConflictError, KubeError, KubeNotFoundError

log = logging.getLogger(__name__)


class Election:
    def __init__(self, *, kube: ControllerKube, namespace: str, node: str, identity: str,
                 duration_s: float, activation_url: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.identity = identity
        self.duration_s = duration_s
        self.activation_url = activation_url
        self.clock = clock
        """The monotonic clock of both rules: this instance's leadership and the others'
        expiry."""
        self.name = naming.controller_lease_name(node)
        self.acquired = asyncio.Event()
        self.lost = asyncio.Event()
        self._valid_until = 0.0
        self._observer = LeaseObserver()
        self._last: ControllerLease | None = None
        """The Lease as this instance last wrote it, while it holds it (the fast path)."""
        self.term = 0
        self.instance = uuid.uuid4().hex
        """This process's id in the Lease (see the module docstring)."""
        self.keep_on_exit = False
        """Set when stopping with work in flight: the Lease is then left to expire."""

    def is_leader(self) -> bool:
        return self.clock() < self._valid_until

    def _body(self, current: ControllerLease | None, transitions: int, *, acquire: bool,
              holder: bool = True) -> dict[str, Any]:
        now = dt.datetime.now(dt.UTC)
        acquired = now if acquire else (None if current is None else current.acquire_time)
        return ControllerLease(
            name=self.name, node=self.node, holder=self.identity if holder else "",
            instance=self.instance, activation_url=self.activation_url, renew_time=now,
            acquire_time=acquired if holder else None, duration_s=self.duration_s,
            transitions=transitions,
            resource_version="" if current is None else current.resource_version,
        ).body(self.namespace)

    async def try_acquire_or_renew(self) -> bool:
        started = self.clock()
        if self._last is not None and self.acquired.is_set() and self.is_leader():
            try:
                self._wrote(await self.kube.replace_lease(self.namespace, self._body(
                    self._last, self._last.transitions, acquire=False)))
                return self._became(started)
            except (KubeConflictError, KubeNotFoundError):
                log.info("controller lease changed since this instance wrote it; reading it",
                         extra={"node": self.node, "identity": self.identity})
            self._last = None
        try:
            current = ControllerLease.parse(await self.kube.get_lease(self.namespace, self.name))
        except KubeNotFoundError:
            try:
                self._wrote(await self.kube.create_lease(
                    self.namespace, self._body(None, 0, acquire=True)))
            except KubeConflictError:
                return self._set(False)
            return self._became(started)
        # Seen when the answer came, not when we asked: a slow answer only delays expiry.
        seen_at = self.clock()
        held = self._observer.observe(current, seen_at).fresh(seen_at)
        ours = current.holder == self.identity and current.instance == self.instance
        if held and not ours:
            if current.holder == self.identity and not self.acquired.is_set():
                log.info("an earlier process of this identity holds the controller lease; "
                         "waiting for it to expire", extra={"node": self.node,
                                                            "identity": self.identity})
            return self._set(False)
        transitions = current.transitions + (0 if ours else 1)
        try:
            self._wrote(await self.kube.replace_lease(self.namespace, self._body(
                current, transitions, acquire=not ours)))
        except KubeConflictError:
            return self._set(False)
        if not ours:
            log.info("took over the controller lease", extra={
                "node": self.node, "identity": self.identity,
                "previous": current.holder or None})
        return self._became(started)

    def _wrote(self, body: dict[str, Any]) -> None:
        self._last = ControllerLease.parse(body)

    def _became(self, started: float) -> bool:
        # Valid from when we *asked*, not when the answer came: a slow answer shortens it.
        self._valid_until = started + self.duration_s * 2 / 3
        if not self.acquired.is_set():
            self.term += 1
            self.acquired.set()
            self.lost.clear()
        return True

    def _set(self, leader: bool) -> bool:
        if not leader and self.acquired.is_set():
            log.warning("lost the controller lease", extra={"node": self.node,
                                                            "identity": self.identity})
            self.acquired.clear()
            self.lost.set()
            self._valid_until = 0.0
        if not leader:
            self._last = None
        return leader

    async def run(self, stop: asyncio.Event) -> None:
        """Acquire and renew until ``stop``; release on the way out."""
        while not stop.is_set():
            try:
                await self.try_acquire_or_renew()
            except KubeError as exc:
                log.warning("controller lease call failed", extra={"error": str(exc)})
            if self.acquired.is_set() and not self.is_leader():
                self._set(False)  # no renewal in time: stop acting before anyone may start
            period = self.duration_s / 3 if self.acquired.is_set() else self.duration_s / 5
            try:
                await asyncio.wait_for(stop.wait(), timeout=period)
            except TimeoutError:
                pass
        if self.keep_on_exit:
            log.warning("stopping with a step in flight; the controller lease is left to "
                        "expire", extra={"node": self.node, "identity": self.identity})
            self._set(False)
            return
        await self.release()

    async def release(self) -> None:
        if not self.acquired.is_set():
            return
        self._set(False)
        try:
            current = ControllerLease.parse(await self.kube.get_lease(self.namespace, self.name))
            if current.holder == self.identity and current.instance == self.instance:
                await self.kube.replace_lease(self.namespace, self._body(
                    current, current.transitions, acquire=False, holder=False))
        except KubeError as exc:
            log.warning("could not release the controller lease", extra={"error": str(exc)})

"""Leadership per node: the controller instance that may act on this node's GPUs.

One Lease per node names the acting instance. An instance acquires it when it is free or
expired, renews it every third of its duration, and considers itself leader only until a
local deadline (``renewed at + duration - margin``, measured on the monotonic clock) so
that an instance cut off from the API server stops acting before anyone else may start.

Losing the Lease sets :attr:`Election.lost`: the node controller stops taking work at once
and every switch stops at its next fencing check (the call in flight is not cancelled: a
wake cannot be called back from an engine).

Each process writes a fresh instance id next to its identity. A restarted process with the
same identity (a container restart keeps the pod name) is therefore *not* the holder: it
waits for the Lease to expire like any other instance, so that calls its predecessor sent
have landed or timed out before it acts. An instance that stops cleanly releases the
Lease, and its successor acquires it at once; one that stops with a step still in flight
(:attr:`Election.keep_on_exit`) leaves it to expire.

Expiry compares the holder's ``renewTime`` with this machine's wall clock, as every
Kubernetes leader election does: instances must share a clock that is not stepped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from typing import Any

from controller import naming
from controller.kube import ControllerKube
from controller.leases import micro_time, parse_micro_time
from driver.errors import KubeConflictError, KubeError, KubeNotFoundError

log = logging.getLogger(__name__)


class NotLeader(RuntimeError):
    """This instance does not (or no longer) hold the node's controller Lease."""


class Election:
    def __init__(self, *, kube: ControllerKube, namespace: str, node: str, identity: str,
                 duration_s: float, activation_url: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.identity = identity
        self.duration_s = duration_s
        self.activation_url = activation_url
        self.name = naming.controller_lease_name(node)
        self.acquired = asyncio.Event()
        self.lost = asyncio.Event()
        self._valid_until = 0.0
        self.term = 0
        self.instance = uuid.uuid4().hex
        """This process's id in the Lease (see the module docstring)."""
        self.keep_on_exit = False
        """Set when stopping with work in flight: the Lease is then left to expire."""

    def is_leader(self) -> bool:
        return time.monotonic() < self._valid_until

    def check(self) -> None:
        """Raise :class:`NotLeader` unless this instance may act now."""
        if not self.is_leader():
            raise NotLeader(f"{self.identity} does not hold the controller lease of "
                            f"{self.node}")

    def _body(self, resource_version: str | None, transitions: int, acquire: bool
              ) -> dict[str, Any]:
        now = micro_time()
        spec: dict[str, Any] = {"holderIdentity": self.identity,
                                "leaseDurationSeconds": max(1, round(self.duration_s)),
                                "renewTime": now, "leaseTransitions": transitions}
        if acquire:
            spec["acquireTime"] = now
        metadata: dict[str, Any] = {
            "name": self.name, "namespace": self.namespace,
            "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
                       naming.LABEL_KIND: naming.KIND_CONTROLLER,
                       naming.LABEL_NODE: naming.label_value(self.node)},
            "annotations": {naming.ACTIVATION_URL: self.activation_url,
                            naming.INSTANCE: self.instance,
                            naming.NODE_NAME: self.node},
        }
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                "spec": spec}

    async def try_acquire_or_renew(self) -> bool:
        started = time.monotonic()
        try:
            current = await self.kube.get_lease(self.namespace, self.name)
        except KubeNotFoundError:
            try:
                await self.kube.create_lease(self.namespace, self._body(None, 0, True))
            except KubeConflictError:
                return self._set(False)
            return self._became(started)
        spec = current.get("spec", {}) or {}
        holder = spec.get("holderIdentity") or ""
        renewed = parse_micro_time(spec.get("renewTime"))
        duration = float(spec.get("leaseDurationSeconds") or self.duration_s)
        expired = renewed is None or (dt.datetime.now(dt.UTC) - renewed).total_seconds() > duration
        instance = ((current.get("metadata") or {}).get("annotations") or {}).get(
            naming.INSTANCE, "")
        ours = holder == self.identity and instance == self.instance
        if holder and not ours and not expired:
            if holder == self.identity and not self.acquired.is_set():
                log.info("an earlier process of this identity holds the controller lease; "
                         "waiting for it to expire", extra={"node": self.node,
                                                            "identity": self.identity})
            return self._set(False)
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        try:
            await self.kube.replace_lease(self.namespace, self._body(
                current["metadata"]["resourceVersion"], transitions, acquire=not ours))
        except KubeConflictError:
            return self._set(False)
        if not ours:
            log.info("took over the controller lease", extra={
                "node": self.node, "identity": self.identity, "previous": holder or None})
        return self._became(started)

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
            current = await self.kube.get_lease(self.namespace, self.name)
            annotations = (current.get("metadata") or {}).get("annotations") or {}
            if ((current.get("spec") or {}).get("holderIdentity") == self.identity
                    and annotations.get(naming.INSTANCE) == self.instance):
                body = self._body(current["metadata"]["resourceVersion"],
                                  int(current["spec"].get("leaseTransitions") or 0), False)
                body["spec"].pop("holderIdentity")
                await self.kube.replace_lease(self.namespace, body)
        except KubeError as exc:
            log.warning("could not release the controller lease", extra={"error": str(exc)})

"""Sends what :mod:`controller.lease.visible_state` builds to the API server, off the switch's path.

A switch never waits for an Event, a label or a condition: callers hand their changes to
:class:`VisibleStateWriter`, which keeps only the latest wanted value per object (a newer
state of a pod replaces an older one not yet sent) and writes them from one background
task. A failed write is retried a few times with the shared backoff and then dropped with a
warning and a count (``rota_controller_visible_state_errors_total{kind}``); the next change of that
object writes it again. A claim's conditions are written as a patch of its
``status.devices`` alone (:meth:`VisibleStateKube.set_claim_devices`): the controller may
not change a claim's allocation, and a whole claim sent back may look changed to the API
server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.visible_state import (
    FIELD_MANAGER,
    SERIES_WINDOW_S,
    EngineState,
    Occurrence,
    awake_conditions,
    device_status,
    event_body,
    event_series_patch,
    merged_devices,
    pod_state_patch,
)
from rota.kit.aio import Backoff, retry, wait_any
from rota.kit.errors import KubeConflictError, KubeError, KubeNotFoundError
from rota.kit.kube import RESOURCE_GROUP, RESOURCE_VERSION, Kube

__all__ = ["VisibleStateKube", "VisibleStateWriter"]

log = logging.getLogger(__name__)

_WRITTEN_CLAIMS = 1024
"""Claims whose last written version is remembered (a node's claims, with room)."""
_ALLOCATION_CHANGED = "status.allocation"
"""In a 422's message: the API server saw the write change the claim's allocation."""

class VisibleStateKube(Kube):
    """The three writes, through the shared facade (threads, timeouts, error mapping)."""

    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        super().__init__(api, timeout_s=timeout_s)
        self._events = client.EventsV1Api(api)
        self._written: dict[tuple[str, str], dict[str, Any]] = {}
        """Claims as this controller's last status write returned them (oldest first)."""
        self._updated: set[tuple[str, str]] = set()
        """Claims whose patch the API server read as a change of their allocation (see
        :meth:`_write_devices`): written by an update."""

    async def create_event(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        await self._call(f"create event {meta['namespace']}/{meta['name']}",
                         self._events.create_namespaced_event, meta["namespace"], body,
                         _preload_content=False)

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(f"patch event {namespace}/{name}",
                         self._events.patch_namespaced_event, name, namespace, patch,
                         _content_type="application/merge-patch+json", _preload_content=False)

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(f"patch pod {namespace}/{name}", self._core.patch_namespaced_pod,
                         name, namespace, patch,
                         _content_type="application/merge-patch+json", _preload_content=False)

    async def set_claim_devices(self, namespace: str, name: str,
                                entries: list[dict[str, Any]]) -> None:
        """Put rota's ``status.devices[]`` entries (and keep every other driver's), with a
        compare-and-swap on the resourceVersion, retried once on a conflict.

        The claim as the last write returned it is the base of the next write (one request
        per change); a claim not written before, or one another writer changed since (a
        409), is read first. The write carries ``status.devices`` alone
        (:meth:`_write_devices`)."""
        key = (namespace, name)
        known = self._written.pop(key, None)
        for attempt in range(2):
            claim = known if known is not None else dict(await self._call(
                f"get resourceclaim {namespace}/{name}",
                self._objects.get_namespaced_custom_object, RESOURCE_GROUP,
                RESOURCE_VERSION, namespace, "resourceclaims", name))
            known = None
            devices = merged_devices((claim.get("status") or {}).get("devices") or [], entries)
            try:
                written = await self._write_devices(namespace, name, claim, devices)
            except KubeConflictError:
                if attempt:
                    raise
                continue
            self._written[key] = written
            while len(self._written) > _WRITTEN_CLAIMS:
                self._written.pop(next(iter(self._written)))
            return

    async def _write_devices(self, namespace: str, name: str, claim: dict[str, Any],
                             devices: list[dict[str, Any]]) -> dict[str, Any]:
        """Write ``devices`` as the claim's ``status.devices`` (under ``claim``'s
        resourceVersion); the claim as written.

        A JSON merge patch of ``status.devices`` and the resourceVersion: the API server
        applies it to the claim as it stores it, so ``status.allocation`` and
        ``reservedFor`` stay as they are, which a controller may not change (without
        ``resourceclaims/binding`` the API server refuses any change, 422). A whole claim
        sent back (an update) does change them whenever the allocation's opaque configs
        are not stored as this client writes JSON: the API server compares their raw bytes,
        and a claim made by kubectl or a controller holds them without spaces, which
        Python's JSON encoder adds. A claim whose configs are stored with those spaces
        (made by a Python client) fails the patch the same way, as the API server re-encodes
        them without: that claim is written by an update instead."""
        patch = {"metadata": {"resourceVersion": (claim.get("metadata") or {})
                              .get("resourceVersion")},
                 "status": {"devices": devices}}
        if (namespace, name) not in self._updated:
            try:
                resp = await self._call(
                    f"patch resourceclaim status {namespace}/{name}",
                    self._objects.patch_namespaced_custom_object_status, RESOURCE_GROUP,
                    RESOURCE_VERSION, namespace, "resourceclaims", name, patch,
                    field_manager=FIELD_MANAGER,
                    _content_type="application/merge-patch+json", _preload_content=False)
                return dict(json.loads(resp.data))
            except KubeError as exc:
                if exc.status != 422 or _ALLOCATION_CHANGED not in str(exc):
                    raise
                self._updated.add((namespace, name))
                while len(self._updated) > _WRITTEN_CLAIMS:
                    self._updated.pop()
        body = dict(claim)
        body["status"] = dict(claim.get("status") or {}) | {"devices": devices}
        resp = await self._call(
            f"update resourceclaim status {namespace}/{name}",
            self._objects.replace_namespaced_custom_object_status, RESOURCE_GROUP,
            RESOURCE_VERSION, namespace, "resourceclaims", name, body,
            field_manager=FIELD_MANAGER, _preload_content=False)
        return dict(json.loads(resp.data))


@dataclass
class _Series:
    namespace: str
    name: str
    first: dt.datetime
    count: int


@dataclass
class _ClaimStatus:
    awake: bool
    ready: bool
    since: dict[str, dt.datetime]


class VisibleStateWriter:
    """Latest-wins queue of visible-state writes, sent by :meth:`run`."""

    def __init__(self, kube: VisibleStateKube, *, instance: str,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
                 attempts: int = 3) -> None:
        self.kube = kube
        self.instance = instance
        self.clock = clock
        self.attempts = attempts
        self._pending: dict[tuple[str, str], Callable[[], Awaitable[None]]] = {}
        self._changed = asyncio.Event()
        self._series: dict[tuple[str, str], _Series] = {}
        self._pod_states: dict[str, EngineState] = {}
        self._claims: dict[str, _ClaimStatus] = {}
        self.idle = asyncio.Event()
        """Set while nothing waits to be written (tests wait on it)."""
        self.idle.set()

    # -- what callers say --------------------------------------------------------------------

    def record(self, occurrence: Occurrence) -> None:
        """Record an Event (or extend its series)."""
        self._queue(("event", f"{occurrence.key[0]}/{occurrence.key[1]}"),
                    lambda: self._write_event(occurrence))

    def pod_state(self, claimant: Claimant, state: EngineState) -> None:
        """Set the engine pod's state label (written only when it changes)."""
        if not claimant.pod_name or not claimant.pod_uid:
            return
        if self._pod_states.get(claimant.pod_uid) is state:
            return
        self._pod_states[claimant.pod_uid] = state
        namespace, name = claimant.namespace, claimant.pod_name
        self._queue(("pod", claimant.pod_uid),
                    lambda: self.kube.patch_pod(namespace, name, pod_state_patch(state)))

    def claim_conditions(self, claimant: Claimant, *, awake: bool, ready: bool, reason: str,
                         message: str) -> None:
        """Set the claim's ``Awake`` and ``Ready`` conditions (written only on change)."""
        now = self.clock()
        known = self._claims.get(claimant.claim_uid)
        if known is not None and (known.awake, known.ready) == (awake, ready):
            return
        since = {"Awake": now, "Ready": now}
        if known is not None:
            since["Awake"] = known.since["Awake"] if known.awake == awake else now
            since["Ready"] = known.since["Ready"] if known.ready == ready else now
        self._claims[claimant.claim_uid] = _ClaimStatus(awake, ready, since)
        entry = device_status(claimant, awake_conditions(awake=awake, ready=ready,
                                                         reason=reason, message=message),
                              since=since, generation=1)
        namespace, name = claimant.namespace, claimant.claim_name
        self._queue(("claim", claimant.claim_uid),
                    lambda: self.kube.set_claim_devices(namespace, name, [entry]))

    def forget(self, *, pod_uids: set[str], claim_uids: set[str]) -> None:
        """Drop what is remembered of pods and claims that are gone (bounded memory)."""
        for uid in list(self._pod_states):
            if uid not in pod_uids:
                del self._pod_states[uid]
        for uid in list(self._claims):
            if uid not in claim_uids:
                del self._claims[uid]
        for key in list(self._series):
            if key[0] not in pod_uids | claim_uids:
                del self._series[key]

    # -- the writer --------------------------------------------------------------------------

    def _queue(self, key: tuple[str, str], write: Callable[[], Awaitable[None]]) -> None:
        self._pending.pop(key, None)  # re-insert: latest wins, and goes last
        self._pending[key] = write
        self.idle.clear()
        self._changed.set()

    async def _write_event(self, occurrence: Occurrence) -> None:
        now = self.clock()
        series = self._series.get(occurrence.key)
        if series is not None and (now - series.first).total_seconds() <= SERIES_WINDOW_S:
            series.count += 1
            try:
                await self.kube.patch_event(series.namespace, series.name,
                                            event_series_patch(occurrence, count=series.count,
                                                               now=now))
                return
            except KubeNotFoundError:
                pass  # expired or deleted: start a new Event
        body = event_body(occurrence, instance=self.instance, now=now)
        await self.kube.create_event(body)
        self._series[occurrence.key] = _Series(body["metadata"]["namespace"],
                                               body["metadata"]["name"], now, 1)

    async def run(self, stop: asyncio.Event) -> None:
        """Write what is pending until ``stop``; then one last bounded flush."""
        while not stop.is_set():
            await wait_any(self._changed, stop)
            self._changed.clear()
            await self.flush()
        await self.flush()

    async def flush(self) -> None:
        while self._pending:
            key = next(iter(self._pending))
            write = self._pending.pop(key)
            try:
                await retry(write, retry_on=(KubeError,),
                            backoff=Backoff(first_s=0.1, max_s=1.0, attempts=self.attempts - 1),
                            transient=_transient)
            except KubeError as exc:
                metrics.VISIBLE_STATE_ERRORS.labels(_error_kind(key[0])).inc()
                log.warning("could not write visible state", extra={
                    "kind": key[0], "object": key[1], "error": str(exc)})
        self.idle.set()


def _transient(exc: BaseException) -> bool:
    """Worth another try: not a refusal, a missing object or an invalid body."""
    return not (isinstance(exc, KubeError) and exc.status in (403, 404, 422))


def _error_kind(key_kind: str) -> str:
    return {"event": "event", "pod": "pod_label", "claim": "claim_conditions"}[key_kind]

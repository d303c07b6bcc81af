"""Watching a campaign from outside: GPU Lease transitions (which is how switches are
counted, so a controller killed mid-switch cannot lose its count) and the GPUs themselves."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch

from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.aio import Backoff

__all__ = ["LeaseObserver", "Transition"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transition:
    """One switch as the GPU Lease tells it: from ``switching`` to what came next."""

    lease: str
    ok: bool
    reason: str


def transition(before: GpuLease | None, after: GpuLease) -> Transition | None:
    """The switch that ended between two versions of one GPU Lease, if one did.

    A switch ends when ``switching`` gives way to another state. It succeeded when the
    same controller instance wrote ``awake`` with no error; a Lease taken over by another
    instance (a crash, a second instance) ends it as ``controller_crash``; otherwise the
    reason is the one the switch wrote in ``last-error``.
    """
    if before is None or before.state != naming.STATE_SWITCHING:
        return None
    if after.state == naming.STATE_SWITCHING and after.fence == before.fence:
        return None
    if after.controller and before.controller and after.controller != before.controller:
        return Transition(after.name, False, "controller_crash")
    if after.state == naming.STATE_AWAKE and not after.last_error:
        return Transition(after.name, True, "")
    if after.state == naming.STATE_SWITCHING:  # a new switch over an unfinished one
        return Transition(after.name, False, "superseded")
    if after.state == naming.STATE_IDLE and not after.last_error:
        return Transition(after.name, True, "")  # a holder put to sleep (idle policy)
    reason = after.last_error.split(":", 1)[0].strip() or after.state
    return Transition(after.name, False, reason)


class LeaseObserver:
    """Watches the GPU Leases of ``namespace`` in a thread and reports every ended switch
    to ``on_transition`` (called in the watch thread)."""

    def __init__(self, api: client.ApiClient, namespace: str,
                 on_transition: Callable[[Transition], None]) -> None:
        self.api = api
        self.namespace = namespace
        self.on_transition = on_transition
        self.leases: dict[str, GpuLease] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-observer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for the thread (a no-op when it never started: a rig that failed
        to come up reports its own error, not this one)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _seen(self, obj: dict[str, Any]) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(naming.LABEL_KIND) != naming.KIND_GPU:
            return
        lease = GpuLease.from_object(obj)
        found = transition(self.leases.get(lease.name), lease)
        self.leases[lease.name] = lease
        if found is not None:
            self.on_transition(found)

    def _run(self) -> None:
        coordination = client.CoordinationV1Api(self.api)
        backoff = Backoff(first_s=0.2, max_s=5.0)
        version = ""
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                if not version:
                    listed = coordination.list_namespaced_lease(
                        self.namespace, _preload_content=False, _request_timeout=10)
                    body = json.loads(listed.data)
                    for item in body.get("items", []):
                        self._seen(item)
                    version = body["metadata"]["resourceVersion"]
                for event in stream.stream(coordination.list_namespaced_lease, self.namespace,
                                           resource_version=version, timeout_seconds=30,
                                           _request_timeout=40):
                    if self._stop.is_set():
                        break
                    obj = self.api.sanitize_for_serialization(event["object"])
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._seen(obj)
                backoff.reset()
            except client.ApiException as exc:
                if exc.status == 410:
                    version = ""  # expired: list again
                if backoff.wait(self._stop):
                    break
            except Exception as exc:
                log.warning("lease watch failed; reopening", extra={"error": repr(exc)[:200]})
                if backoff.wait(self._stop):
                    break
            finally:
                stream.stop()

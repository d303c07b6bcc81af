"""Feeds the routing state from the Kubernetes API: lists and watches, in worker threads.

The official ``kubernetes`` client is synchronous, so each watch runs in its own daemon
thread and hands every event to the event loop with ``loop.call_soon_threadsafe``; the
loop alone touches the :class:`~controller.gateway.routing.RoutingState`. Objects travel
as the API's JSON (dicts).

What is watched:

- ResourceClaims (``resource.k8s.io/v1``) in all namespaces, or, with
  ``--claim-namespaces`` (the chart sets its ``engineNamespaces``), one watch per named
  namespace, which a Role in each allows instead of a ClusterRole; the state keeps those
  allocated by ``gpu.rota.dev``. The state is synced once every claim watch has listed.
- Pods, only in the namespaces that hold such claims: one watch per namespace, started
  when its first rota claim appears and stopped when its last one goes. Pods cannot be
  selected by the claims they use (no label or field selector says so), and watching every
  pod of a cluster would send each gateway replica every pod change; engines live in few
  namespaces. RBAC needs list/watch on pods in those namespaces (a ClusterRole is simplest).
- Leases in the controller namespace labelled ``app.kubernetes.io/managed-by=rota`` (GPU
  and controller Leases).

Each watch is a :class:`rota.kit.listwatch.ListWatch`, the one list-then-watch of rota's
processes: it lists in pages of :data:`LIST_PAGE` objects, each page cut down to what
routing keeps (claims of rota's driver only, slim claims and pods) before the next is read,
so a relist of a large fleet never holds the whole response at once; the state applies the
list as the differences from what it held. Then it watches from the list's
resourceVersion. After a connection error or an API server restart it resumes the watch
from the last version it saw (no new list); it lists again only after a 410 Gone and every
``resync_s``, with bounded, jittered exponential backoff between attempts. The state is
marked synced once claims, Leases and the pods of every namespace known at that time have
been listed.

A namespace whose pods this gateway may not list (403: the chart grants pod reads only in
``engineNamespaces``, while the model binding may name ``*`` or patterns, and any tenant
may create a claim) never holds the others up: the state is marked synced without it, its
pods are dropped from the state, so its claimants get no traffic and are never woken, and
its list is tried again in the background on a bounded, jittered back-off (a slower one
than for other errors: a 403 lasts until an admin changes RBAC). It is logged once (a
warning with the ``namespace``), counted in ``rota_gateway_forbidden_namespaces``, and
served again as soon as a list succeeds. A 403 on claims or Leases is not skipped: without
them the gateway knows nothing, and ``/readyz`` stays 503.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from kubernetes import client

from controller.gateway.lease_view import slim_claim, slim_pod
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.routing import ObjectKind, RoutingState, claim_is_ours
from controller.gateway.settings import GatewaySettings
from rota.api import naming
from rota.kit.aio import Backoff, wait_any
from rota.kit.kube import load_api_client
from rota.kit.listwatch import ListWatch

__all__ = ["KubeSource"]

log = logging.getLogger(__name__)

GROUP, VERSION = "resource.k8s.io", "v1"
_BACKOFF_S = 0.5
_BACKOFF_MAX_S = 30.0
_FORBIDDEN_BACKOFF_S = 1.0
_FORBIDDEN_BACKOFF_MAX_S = 60.0
"""Pauses between lists of a namespace whose pods this gateway may not list (403)."""
LIST_PAGE = 500
"""Objects per list page (the API server's own default chunk size for its reflectors)."""


def _cut(kind: ObjectKind, obj: dict[str, Any]) -> dict[str, Any]:
    """What the state keeps of a listed or watched object (pure; run in the thread)."""
    if kind == "claim":
        return slim_claim(obj)
    if kind == "pod":
        return slim_pod(obj)
    return obj


class _Watch:
    """One resource (in one namespace or all) followed into the routing state."""

    def __init__(self, resource: str, kind: ObjectKind, namespace: str | None,
                 list_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 *, loop: asyncio.AbstractEventLoop, state: RoutingState,
                 settings: GatewaySettings, after_event: Callable[[], None],
                 on_restart: Callable[[str], None],
                 on_forbidden: Callable[[_Watch, str | None], None] | None = None,
                 on_undecodable: Callable[[str], None] = lambda resource: None) -> None:
        """``on_forbidden``, when given, makes a 403 skippable: it is called on the loop
        with the error when the watch becomes forbidden, and with None when it lists
        again; the watch keeps trying meanwhile. Without it a 403 is an error like any
        other."""
        self.resource = resource
        self.kind = kind
        self.namespace = namespace
        self._state = state
        self._after_event = after_event
        self._on_forbidden = on_forbidden
        self.forbidden = asyncio.Event()
        """Set (on the loop) while the last list was refused with 403 (skippable watches)."""
        self._stopped = False
        self._follow = ListWatch(
            f"{resource}/{namespace or 'all'}", list_fn, *args, loop=loop,
            on_replace=self._replace, on_event=self._apply,
            keep=claim_is_ours if kind == "claim" else None,
            cut=functools.partial(_cut, kind), label_selector=kwargs.get("label_selector"),
            page_size=LIST_PAGE, watch_timeout_s=settings.watch_timeout_s,
            api_timeout_s=settings.api_timeout_s, relist_s=settings.resync_s,
            backoff=Backoff(first_s=_BACKOFF_S, max_s=_BACKOFF_MAX_S),
            on_error=lambda exc: on_restart(resource),
            on_undecodable=lambda bad: on_undecodable(resource),
            on_forbidden=self._forbid if on_forbidden is not None else None,
            forbidden_backoff=Backoff(first_s=_FORBIDDEN_BACKOFF_S,
                                      max_s=_FORBIDDEN_BACKOFF_MAX_S))

    @property
    def listed(self) -> asyncio.Event:
        """Set (on the loop) once a list has been delivered."""
        return self._follow.listed

    def start(self) -> None:
        self._follow.start()

    def stop(self) -> None:
        self._stopped = True
        self._follow.stop()

    def _replace(self, items: list[dict[str, Any]]) -> None:
        if self._stopped:
            return
        self._state.replace(self.kind, items, namespace=self.namespace)
        if self.forbidden.is_set():
            self.forbidden.clear()
            if self._on_forbidden is not None:
                self._on_forbidden(self, None)
        self._after_event()

    def _forbid(self, error: str) -> None:
        """The list was refused (403): nothing of this namespace may be served."""
        if self._stopped or self.forbidden.is_set():
            return
        self.forbidden.set()
        # What an earlier list showed can no longer be followed: drop it.
        self._state.replace(self.kind, [], namespace=self.namespace)
        if self._on_forbidden is not None:
            self._on_forbidden(self, error)
        self._after_event()

    def _apply(self, event: str, obj: dict[str, Any]) -> None:
        if self._stopped:
            return
        self._state.apply(self.kind, event, obj)
        self._after_event()


class KubeSource:
    """A :class:`~controller.gateway.routing.RoutingSource` backed by the Kubernetes API."""

    def __init__(self, settings: GatewaySettings, *, api: client.ApiClient | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self._settings = settings
        self._api = api
        self._metrics = metrics
        self._pods: dict[str, _Watch] = {}

    def _restarted(self, resource: str) -> None:
        if self._metrics is not None:
            self._metrics.watch_restarts.labels(resource).inc()

    def _undecodable(self, resource: str) -> None:
        """Counted in the watch's thread (a Counter takes its own lock)."""
        if self._metrics is not None:
            self._metrics.undecodable_objects.labels(resource).inc()

    @property
    def forbidden_namespaces(self) -> list[str]:
        """Namespaces with rota claims whose pods this gateway may not list now."""
        return sorted(ns for ns, w in self._pods.items() if w.forbidden.is_set())

    def _count_forbidden(self) -> None:
        if self._metrics is not None:
            self._metrics.forbidden_namespaces.set(len(self.forbidden_namespaces))

    def _pods_forbidden(self, pod_watch: _Watch, error: str | None) -> None:
        """A namespace's pod list became refused (``error``) or allowed again (None)."""
        if error is not None:
            log.warning("may not list the pods of a namespace holding rota claims; its "
                        "claimants get no traffic (grant pod list/watch there, e.g. add it "
                        "to the chart's engineNamespaces); trying again in the background",
                        extra={"namespace": pod_watch.namespace, "error": error})
        else:
            log.info("pods of a namespace listed again; its claimants may be served",
                     extra={"namespace": pod_watch.namespace})
        self._count_forbidden()

    async def run(self, state: RoutingState) -> None:
        own_api = self._api is None
        api: client.ApiClient = (
            self._api if self._api is not None
            else await asyncio.to_thread(load_api_client, self._settings.kubeconfig))
        loop = asyncio.get_running_loop()
        namespaces_changed = asyncio.Event()

        def make(resource: str, kind: ObjectKind, namespace: str | None,
                 list_fn: Callable[..., Any], *args: Any, after: Callable[[], None] = lambda: None,
                 on_forbidden: Callable[[_Watch, str | None], None] | None = None,
                 **kwargs: Any) -> _Watch:
            return _Watch(resource, kind, namespace, list_fn, args, kwargs, loop=loop,
                          state=state, settings=self._settings, after_event=after,
                          on_restart=self._restarted, on_forbidden=on_forbidden,
                          on_undecodable=self._undecodable)

        objects = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        leases = client.CoordinationV1Api(api)

        def pods(namespace: str) -> _Watch:
            return make("pods", "pod", namespace, core.list_namespaced_pod, namespace,
                        on_forbidden=self._pods_forbidden)

        claim_watches = [
            make("resourceclaims", "claim", namespace, objects.list_namespaced_custom_object,
                 GROUP, VERSION, namespace, "resourceclaims", after=namespaces_changed.set)
            for namespace in self._settings.claim_namespaces
        ] or [make("resourceclaims", "claim", None, objects.list_cluster_custom_object,
                   GROUP, VERSION, "resourceclaims", after=namespaces_changed.set)]
        lease_watch = make("leases", "lease", None, leases.list_namespaced_lease,
                           self._settings.controller_namespace,
                           label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGED_BY}")
        watches = [*claim_watches, lease_watch]
        try:
            for w in watches:
                w.start()
            for w in watches:
                await w.listed.wait()
            self._reconcile_pods(state, pods)
            for pod_watch in list(self._pods.values()):
                # A namespace whose pods may not be listed holds nobody up.
                await wait_any(pod_watch.listed, pod_watch.forbidden)
            state.mark_synced()
            synced: dict[str, object] = {"models": len(state.models()),
                                         "namespaces": sorted(self._pods)}
            if self.forbidden_namespaces:  # each was logged when refused
                synced["forbidden_namespaces"] = self.forbidden_namespaces
            log.info("routing state synced", extra=synced)
            while True:
                await wait_any(namespaces_changed, state.binding_changed)
                namespaces_changed.clear()
                state.binding_changed.clear()
                self._reconcile_pods(state, pods)
        finally:
            for w in [*watches, *self._pods.values()]:
                w.stop()
            self._pods.clear()
            self._count_forbidden()
            if own_api:
                await asyncio.to_thread(api.close)

    def _reconcile_pods(self, state: RoutingState, make: Callable[[str], _Watch]) -> None:
        wanted = state.claim_namespaces()
        for namespace in sorted(wanted - set(self._pods)):
            log.info("watching pods of a namespace with rota claims",
                     extra={"namespace": namespace})
            self._pods[namespace] = make(namespace)
            self._pods[namespace].start()
        for namespace in sorted(set(self._pods) - wanted):
            log.info("no rota claims left; no longer watching pods",
                     extra={"namespace": namespace})
            self._pods.pop(namespace).stop()
            state.replace("pod", [], namespace=namespace)
            self._count_forbidden()

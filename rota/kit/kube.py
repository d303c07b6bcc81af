"""The driver's only door to the Kubernetes API.

The official client is synchronous, so every call runs in a worker thread and the event
loop never blocks. Objects travel as plain dicts (the API's JSON), which keeps rota
independent of the client's generated model classes. Every call has a timeout; API
exceptions become :mod:`driver.errors` classes here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from rota.kit import kube_client
from rota.kit.errors import ConfigError, KubeConflictError, KubeError, KubeNotFoundError
from rota.kit.listwatch import (
    ListWatch,
    Undecodable,
    decode,
    decode_object,
    decode_page,
    report_fields,
)

log = logging.getLogger(__name__)

ClientAgent = kube_client.ClientAgent
use_client_agent = kube_client.use
apply_client_agent = kube_client.apply
"""The controller's door to :mod:`rota.kit.kube_client` (it takes only named driver modules)."""

T = TypeVar("T")
Obj = dict[str, Any]

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"
_BODY_LIMIT = 256
_MAX_PAGES = 100


def load_api_client(kubeconfig: str | None, *, agent: kube_client.ClientAgent | None = None
                    ) -> client.ApiClient:
    """An ApiClient from a kubeconfig file, or from the pod's service account, sending
    ``agent``'s User-Agent under its rate limit (the process's, see
    :mod:`rota.kit.kube_client`, when ``agent`` is None)."""
    if kubeconfig:
        api = config.new_client_from_config(config_file=kubeconfig)
    else:
        config.load_incluster_config()
        api = client.ApiClient()
    return kube_client.apply(api, agent)


def _translate(exc: client.ApiException, what: str) -> KubeError:
    body = (exc.body or "")
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    message = body
    try:
        message = decode(body).get("message", body)
    except (Undecodable, AttributeError):
        pass
    detail = f"{what}: HTTP {exc.status}: {str(message)[:_BODY_LIMIT]}"
    if exc.status == 404:
        return KubeNotFoundError(detail, status=404)
    if exc.status == 409:
        return KubeConflictError(detail, status=409)
    return KubeError(detail, status=exc.status)


def _object(what: str, data: bytes) -> Obj:
    """One object read from the API, decoded with a bounded depth (see
    :mod:`rota.kit.listwatch`): one that cannot be decoded is an error of the read."""
    try:
        return decode_object(data)
    except Undecodable as exc:
        raise KubeError(f"{what}: the answer cannot be decoded: {exc.reason}") from None


def _items(what: str, data: bytes) -> tuple[list[Obj], Obj]:
    """The items of one list page, each decoded on its own, and the list's metadata: an
    item that cannot be decoded is skipped and logged, never a failed list.

    Raises:
        KubeError: the answer's envelope cannot be decoded."""
    try:
        page = decode_page(data)
    except Undecodable as exc:
        raise KubeError(f"{what}: the answer cannot be decoded: {exc.reason}") from None
    items: list[Obj] = []
    for item in page.items:
        if isinstance(item, Undecodable):
            log.warning("skipped an object that cannot be decoded",
                        extra={"what": what, **report_fields(item)})
        else:
            items.append(item)
    return items, page.meta


def _as_slice(item: Obj) -> Obj:
    """Items of a list carry no apiVersion and kind; give them back, so that they compare
    equal to single-object reads."""
    return {"apiVersion": f"{RESOURCE_GROUP}/{RESOURCE_VERSION}", "kind": "ResourceSlice",
            **item}


class Kube:
    """Async facade over the calls the driver makes. ``timeout_s`` bounds each call."""

    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self._core = client.CoreV1Api(api)
        self._objects = client.CustomObjectsApi(api)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", self.timeout_s)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except client.ApiException as exc:
            raise _translate(exc, what) from exc
        except OSError as exc:  # connection refused, reset, timeouts from urllib3
            raise KubeError(f"{what}: {exc}") from exc
        except RecursionError as exc:  # an answer the client decoded nests too deep
            raise KubeError(f"{what}: the answer cannot be decoded: {exc}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError(f"{what}: {exc}") from exc
            raise

    # -- core ------------------------------------------------------------------------

    async def get_node(self, name: str) -> Obj:
        resp = await self._call(f"get node {name}", self._core.read_node, name,
                                _preload_content=False)
        return _object(f"get node {name}", resp.data)

    async def list_pods_on_node(self, node: str) -> list[Obj]:
        """Every pod bound to ``node`` (all namespaces, one page per 500, bounded)."""
        pods: list[Obj] = []
        token: str | None = None
        for _ in range(_MAX_PAGES):
            kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={node}", "limit": 500}
            if token:
                kwargs["_continue"] = token
            resp = await self._call(f"list pods on node {node}",
                                    self._core.list_pod_for_all_namespaces,
                                    _preload_content=False, **kwargs)
            items, meta = _items(f"list pods on node {node}", resp.data)
            pods.extend(items)
            token = meta.get("continue")
            if not token:
                return pods
        raise KubeError(f"list pods on node {node}: more than {_MAX_PAGES} pages")

    # -- resource.k8s.io ----------------------------------------------------------------

    async def get_claim(self, namespace: str, name: str) -> Obj:
        """One claim; a claim that cannot be decoded (a tenant's opaque parameters nested
        past :data:`rota.kit.listwatch.MAX_DEPTH`) raises KubeError like a failed read."""
        what = f"get resourceclaim {namespace}/{name}"
        resp = await self._call(what, self._objects.get_namespaced_custom_object,
                                RESOURCE_GROUP, RESOURCE_VERSION, namespace, "resourceclaims",
                                name, _preload_content=False)
        return _object(what, resp.data)

    async def list_slices(self, *, driver: str, node: str) -> list[Obj]:
        resp = await self._call(
            "list resourceslices", self._objects.list_cluster_custom_object,
            RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices",
            field_selector=f"spec.driver={driver},spec.nodeName={node}",
            _preload_content=False)
        items, _ = _items("list resourceslices", resp.data)
        return [_as_slice(item) for item in items]

    async def create_slice(self, body: Obj) -> Obj:
        return dict(await self._call(
            f"create resourceslice {body['metadata']['name']}",
            self._objects.create_cluster_custom_object,
            RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", body))

    async def replace_slice(self, body: Obj) -> Obj:
        """Update with the resourceVersion in ``body`` (compare-and-swap)."""
        name = body["metadata"]["name"]
        return dict(await self._call(
            f"update resourceslice {name}", self._objects.replace_cluster_custom_object,
            RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", name, body))

    async def delete_slice(self, name: str, *, uid: str | None = None,
                           resource_version: str | None = None) -> None:
        preconditions: dict[str, str] = {}
        if uid:
            preconditions["uid"] = uid
        if resource_version:
            preconditions["resourceVersion"] = resource_version
        body = {"apiVersion": "v1", "kind": "DeleteOptions",
                "preconditions": preconditions} if preconditions else None
        try:
            await self._call(f"delete resourceslice {name}",
                             self._objects.delete_cluster_custom_object,
                             RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", name,
                             body=body)
        except KubeNotFoundError:
            return

    def slice_watch(self, *, driver: str, node: str, loop: asyncio.AbstractEventLoop,
                    on_replace: Callable[[list[Obj]], None],
                    on_event: Callable[[str, Obj], None],
                    relist_s: float | None = None) -> ListWatch:
        """A list-watch (not started) of the slices of ``driver`` on ``node``."""
        return ListWatch("resourceslices", self._objects.list_cluster_custom_object,
                         RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", loop=loop,
                         on_replace=on_replace, on_event=on_event,
                         field_selector=f"spec.driver={driver},spec.nodeName={node}",
                         api_timeout_s=self.timeout_s, relist_s=relist_s, cut=_as_slice)


def check_kubeconfig(kubeconfig: str | None, *, context: str | None = None,
                     in_cluster: bool = True) -> None:
    """Load the kubeconfig once, into a throwaway configuration, before anything else
    starts: a missing file, a context that is not there or a machine outside a cluster is
    one line for the user, not a traceback from deep inside the start. With no
    ``kubeconfig``, ``in_cluster`` components (the driver, the controller, the gateway) use
    the pod's service account, as :func:`rota.kit.kube.load_api_client` does; a user's tool
    reads ``$KUBECONFIG`` or ``~/.kube/config``, as kubectl does.

    Raises:
        ConfigError: it cannot be loaded; the message says which and why.
    """
    import yaml
    from kubernetes.config.config_exception import ConfigException

    if kubeconfig is not None and not Path(kubeconfig).is_file():
        raise ConfigError(f"cannot load kubeconfig {kubeconfig}: no such file")
    target = client.Configuration()
    service_account = kubeconfig is None and in_cluster
    try:
        if service_account:
            config.load_incluster_config(client_configuration=target)
        else:
            config.load_kube_config(config_file=kubeconfig, context=context,
                                    client_configuration=target)
    except (ConfigException, OSError, ValueError, TypeError, AttributeError,
            yaml.YAMLError) as exc:
        named = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        where = ("the pod's service account (not in a cluster? pass --kubeconfig)"
                 if service_account else f"kubeconfig {named}")
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"cannot load {where}: {detail}") from None

"""The node agent's pod lifecycle: prepare claims, start the engine, report status,
stop and unprepare on deletion. See the package docstring for why it exists."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from kubernetes import client, watch

from e2e.node_agent import kubelet_api
from e2e.node_agent.cdi import CdiResolveError, resolve_env

log = logging.getLogger(__name__)

SIMULATOR_IMAGE = "rota/engine-simulator"
RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"
_API_TIMEOUT = 10.0


class PrepareFailed(RuntimeError):
    """The driver refused (or could not be asked) to prepare a pod's claims."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ip_block_for(node: str) -> str:
    """A /24 of loopback addresses for one node (127.<n>.<m>.x), stable per node name."""
    digest = hashlib.sha256(node.encode()).digest()
    return f"127.{1 + digest[0] % 250}.{digest[1]}"


@dataclass
class PodRuntime:
    uid: str
    namespace: str
    name: str
    ip: str
    claims: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(driver, namespace, uid, name) of every prepared claim."""
    process: asyncio.subprocess.Process | None = None
    supervisor: asyncio.Task[None] | None = None
    restarts: int = 0
    stopping: bool = False


class NodeAgent:
    """Runs until ``stop`` is set. Everything it starts, it stops."""

    def __init__(self, *, api: client.ApiClient, node: str, registry_dir: Path,
                 cdi_root: Path, log_dir: Path, extra_env: Mapping[str, str] | None = None,
                 python: str = sys.executable) -> None:
        self.api = api
        self.node = node
        self.registry_dir = registry_dir
        self.cdi_root = cdi_root
        self.log_dir = log_dir
        self.extra_env = dict(extra_env or {})
        self.python = python
        self.core = client.CoreV1Api(api)
        self.objects = client.CustomObjectsApi(api)
        self.drivers: dict[str, kubelet_api.DriverEndpoint] = {}
        self.pods: dict[str, PodRuntime] = {}
        self.claim_users: dict[str, set[str]] = {}
        self._ip_block = ip_block_for(node)
        self._pod_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.ready = asyncio.Event()

    # -- main loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        halt = threading.Event()
        watcher = threading.Thread(target=self._watch_pods, args=(loop, queue, halt),
                                   name=f"pods-{self.node}", daemon=True)
        watcher.start()
        self.ready.set()
        stopper = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, stopper},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                kind, pod = getter.result()
                self._spawn(self._handle(kind, pod))
        finally:
            stopper.cancel()
            halt.set()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await asyncio.gather(*(self._stop_engine(p) for p in list(self.pods.values())),
                                 return_exceptions=True)
            await asyncio.to_thread(watcher.join, 5)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watch_pods(self, loop: asyncio.AbstractEventLoop,
                    queue: asyncio.Queue[tuple[str, dict[str, Any]]],
                    halt: threading.Event) -> None:
        backoff = 0.2
        while not halt.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.core.list_pod_for_all_namespaces,
                                      field_selector=f"spec.nodeName={self.node}",
                                      timeout_seconds=20, _request_timeout=30):
                    if halt.is_set():
                        break
                    obj = self.api.sanitize_for_serialization(event["object"])
                    loop.call_soon_threadsafe(queue.put_nowait, (str(event["type"]), obj))
                    backoff = 0.2
            except Exception as exc:
                if halt.is_set():
                    break
                log.warning("pod watch failed; reopening", extra={"error": str(exc)[:200]})
                halt.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                w.stop()

    # -- per-pod handling ---------------------------------------------------------------

    async def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        lock = self._pod_locks.setdefault(uid, asyncio.Lock())
        async with lock:
            if kind == "DELETED" or meta.get("deletionTimestamp"):
                await self._terminate(pod, deleted=kind == "DELETED")
            elif uid not in self.pods and pod.get("status", {}).get("phase") in (
                    None, "Pending"):
                await self._start(pod)

    async def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        runtime = PodRuntime(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"],
                             ip=self._allocate_ip())
        self.pods[runtime.uid] = runtime
        delay = 0.2
        while True:
            try:
                devices = await self._prepare_claims(pod, runtime)
                break
            except PrepareFailed as exc:
                await self._event(pod, "FailedPrepareDynamicResources", str(exc), "Warning")
                current = await self._read_pod(runtime)
                if current is None or current["metadata"].get("deletionTimestamp"):
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        container = pod["spec"]["containers"][0]
        image = str(container.get("image", ""))
        if image.split(":")[0] != SIMULATOR_IMAGE:
            await self._patch_status(runtime, self._status_failed(
                container["name"], "ImageNotSupported",
                f"the node agent runs only {SIMULATOR_IMAGE}, not {image!r}"))
            return
        try:
            env = self._container_env(pod, runtime, container, devices)
        except CdiResolveError as exc:
            await self._event(pod, "FailedCDI", str(exc), "Warning")
            return
        runtime.supervisor = asyncio.create_task(self._supervise(runtime, container, env))

    async def _prepare_claims(self, pod: dict[str, Any], runtime: PodRuntime
                              ) -> dict[str, list[Any]]:
        """Prepare every DRA claim of the pod; returns claim name -> devices."""
        by_driver: dict[str, list[tuple[str, str, str]]] = {}
        pod_claim_names: dict[str, str] = {}
        statuses = {s["name"]: s.get("resourceClaimName")
                    for s in pod.get("status", {}).get("resourceClaimStatuses", []) or []}
        for ref in pod["spec"].get("resourceClaims", []) or []:
            claim_name = ref.get("resourceClaimName") or statuses.get(ref["name"])
            if not claim_name:
                raise PrepareFailed(f"claim for {ref['name']} not generated yet")
            claim = await self._get_claim(runtime.namespace, claim_name)
            reserved = {r.get("uid") for r in claim.get("status", {}).get("reservedFor", [])}
            if runtime.uid not in reserved:
                raise PrepareFailed(f"pod is not in reservedFor of claim {claim_name}")
            results = claim["status"]["allocation"]["devices"]["results"]
            for driver in sorted({r["driver"] for r in results}):
                by_driver.setdefault(driver, []).append(
                    (runtime.namespace, claim["metadata"]["uid"], claim_name))
            pod_claim_names[ref["name"]] = claim["metadata"]["uid"]
        devices_by_claim: dict[str, list[Any]] = {}
        for driver, claims in by_driver.items():
            endpoint = await self._endpoint(driver)
            try:
                response = await kubelet_api.prepare(endpoint, claims)
            except grpc.aio.AioRpcError as exc:
                raise PrepareFailed(f"NodePrepareResources on {driver}: {exc.details()}") from exc
            for ns, uid, name in claims:
                if uid not in response.claims:
                    raise PrepareFailed(f"driver {driver} skipped claim {ns}/{name}")
                entry = response.claims[uid]
                if entry.error:
                    raise PrepareFailed(f"claim {ns}/{name}: {entry.error}")
                devices_by_claim[uid] = list(entry.devices)
                runtime.claims.append((driver, ns, uid, name))
                self.claim_users.setdefault(uid, set()).add(runtime.uid)
        return {ref: devices_by_claim.get(uid, []) for ref, uid in pod_claim_names.items()}

    async def _endpoint(self, driver: str) -> kubelet_api.DriverEndpoint:
        if driver not in self.drivers:
            self.drivers.update(await kubelet_api.discover(self.registry_dir))
        if driver not in self.drivers:
            raise PrepareFailed(f"DRA driver {driver} is not registered on node {self.node}")
        return self.drivers[driver]

    @staticmethod
    def _field(pod: dict[str, Any], runtime: PodRuntime, path: str) -> str:
        """The downward API fields engines use."""
        values = {"metadata.uid": runtime.uid, "metadata.name": runtime.name,
                  "metadata.namespace": runtime.namespace, "status.podIP": runtime.ip,
                  "spec.nodeName": pod["spec"].get("nodeName", "")}
        return str(values.get(path, ""))

    def _container_env(self, pod: dict[str, Any], runtime: PodRuntime,
                       container: dict[str, Any], devices: dict[str, list[Any]]
                       ) -> dict[str, str]:
        ids: list[str] = []
        for ref in container.get("resources", {}).get("claims", []) or []:
            request = ref.get("request", "")
            for device in devices.get(ref["name"], []):
                if not request or not device.request_names or request in device.request_names:
                    ids.extend(device.cdi_device_ids)
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME",
                                                             "LANG", "VIRTUAL_ENV")}
        env.update(self.extra_env)
        for item in container.get("env", []) or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif field_path := (item.get("valueFrom") or {}).get("fieldRef", {}).get(
                    "fieldPath"):
                env[item["name"]] = self._field(pod, runtime, str(field_path))
        env.update(resolve_env(self.cdi_root, ids))
        return env

    # -- engine processes ----------------------------------------------------------------

    async def _supervise(self, runtime: PodRuntime, container: dict[str, Any],
                         env: dict[str, str]) -> None:
        """Run the engine; restart it (with backoff) when it exits, like restartPolicy Always."""
        backoff = 0.5
        name = container["name"]
        while not runtime.stopping:
            argv = [self.python, "-m", "e2e.engine_simulator", "--host", runtime.ip,
                    *[str(a) for a in container.get("args", []) or []]]
            command = [str(c) for c in container.get("command", []) or []]
            if command[:1] == ["rota-engine-gate"]:
                # rota's start gate in front of the engine, as in a real engine pod
                gate = command[1:] if "--" in command else [*command[1:], "--"]
                argv = [self.python, "-m", "controller.engine_gate", *gate, *argv]
            self.log_dir.mkdir(parents=True, exist_ok=True)
            logfile = (self.log_dir / f"{runtime.namespace}_{runtime.name}_{name}.log").open("ab")
            try:
                runtime.process = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=logfile,
                    stderr=asyncio.subprocess.STDOUT)
            finally:
                logfile.close()
            port = int(env.get("ROTA_ENGINE_PORT", "8000"))
            await self._patch_status(runtime, self._status_running(name, runtime, ready=False))
            if await self._wait_healthy(runtime, port):
                await self._patch_status(runtime, self._status_running(name, runtime,
                                                                       ready=True))
            code = await runtime.process.wait()
            if runtime.stopping:
                return
            runtime.restarts += 1
            log.warning("engine exited; restarting", extra={
                "pod": f"{runtime.namespace}/{runtime.name}", "code": code,
                "restarts": runtime.restarts})
            await self._patch_status(runtime, self._status_running(name, runtime, ready=False))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _wait_healthy(self, runtime: PodRuntime, port: int,
                            timeout_s: float = 24 * 3600.0) -> bool:
        """Probe /health until it answers while the process lives (a kubelet's readiness
        probe does not stop either: an engine held at its start gate becomes ready once
        it is let through and up)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        delay = 0.05
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while asyncio.get_running_loop().time() < deadline:
                if runtime.process is None or runtime.process.returncode is not None:
                    return False
                try:
                    async with session.get(f"http://{runtime.ip}:{port}/health") as resp:
                        if resp.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 0.5)
        return False

    async def _stop_engine(self, runtime: PodRuntime) -> None:
        runtime.stopping = True
        proc = runtime.process
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if runtime.supervisor is not None:
            runtime.supervisor.cancel()
            await asyncio.gather(runtime.supervisor, return_exceptions=True)

    async def _terminate(self, pod: dict[str, Any], *, deleted: bool) -> None:
        uid = pod["metadata"]["uid"]
        runtime = self.pods.pop(uid, None)
        if runtime is not None:
            await self._stop_engine(runtime)
            await self._unprepare(runtime)
        if not deleted:
            try:
                await asyncio.to_thread(
                    self.core.delete_namespaced_pod, pod["metadata"]["name"],
                    pod["metadata"]["namespace"], grace_period_seconds=0,
                    body={"preconditions": {"uid": uid}}, _request_timeout=_API_TIMEOUT)
            except client.ApiException as exc:
                if exc.status not in (404, 409):
                    raise
        self._pod_locks.pop(uid, None)

    async def _unprepare(self, runtime: PodRuntime) -> None:
        by_driver: dict[str, list[tuple[str, str, str]]] = {}
        for driver, ns, uid, name in runtime.claims:
            users = self.claim_users.get(uid, set())
            users.discard(runtime.uid)
            if users:
                continue  # another pod on this node still uses the claim
            self.claim_users.pop(uid, None)
            by_driver.setdefault(driver, []).append((ns, uid, name))
        for driver, claims in by_driver.items():
            endpoint = await self._endpoint(driver)
            delay = 0.2
            for _ in range(8):
                try:
                    response = await kubelet_api.unprepare(endpoint, claims)
                    errors = {u: e.error for u, e in response.claims.items() if e.error}
                    if not errors:
                        break
                    log.warning("unprepare failed; retrying", extra={"errors": errors})
                except grpc.aio.AioRpcError as exc:
                    log.warning("unprepare call failed; retrying",
                                extra={"error": exc.details()})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- API helpers --------------------------------------------------------------------

    def _allocate_ip(self) -> str:
        used = {p.ip for p in self.pods.values()}
        for host in range(2, 255):
            ip = f"{self._ip_block}.{host}"
            if ip not in used:
                return ip
        raise RuntimeError(f"node {self.node} ran out of loopback pod IPs")

    async def _get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return dict(await asyncio.to_thread(
                self.objects.get_namespaced_custom_object, RESOURCE_GROUP, RESOURCE_VERSION,
                namespace, "resourceclaims", name, _request_timeout=_API_TIMEOUT))
        except client.ApiException as exc:
            raise PrepareFailed(f"claim {namespace}/{name}: HTTP {exc.status}") from exc

    async def _read_pod(self, runtime: PodRuntime) -> dict[str, Any] | None:
        try:
            pod = await asyncio.to_thread(self.core.read_namespaced_pod, runtime.name,
                                          runtime.namespace, _request_timeout=_API_TIMEOUT)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data: dict[str, Any] = self.api.sanitize_for_serialization(pod)
        return data if data["metadata"]["uid"] == runtime.uid else None

    def _status_running(self, container: str, runtime: PodRuntime, *, ready: bool
                        ) -> dict[str, Any]:
        flag = "True" if ready else "False"
        now = _now()
        return {
            "phase": "Running", "podIP": runtime.ip, "podIPs": [{"ip": runtime.ip}],
            "hostIP": "127.0.0.1", "startTime": now,
            "conditions": [{"type": t, "status": s, "lastTransitionTime": now} for t, s in (
                ("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag),
                ("Ready", flag))],
            "containerStatuses": [{
                "name": container, "ready": ready, "started": True,
                "restartCount": runtime.restarts, "image": SIMULATOR_IMAGE, "imageID": "",
                "state": {"running": {"startedAt": now}},
            }],
        }

    @staticmethod
    def _status_failed(container: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "phase": "Failed", "reason": reason, "message": message,
            "containerStatuses": [{
                "name": container, "ready": False, "restartCount": 0, "image": "",
                "imageID": "", "state": {"waiting": {"reason": reason, "message": message}},
            }],
        }

    async def _patch_status(self, runtime: PodRuntime, status: dict[str, Any]) -> None:
        try:
            await asyncio.to_thread(self.core.patch_namespaced_pod_status, runtime.name,
                                    runtime.namespace, {"status": status},
                                    _request_timeout=_API_TIMEOUT)
        except client.ApiException as exc:
            if exc.status != 404:
                log.warning("pod status update failed", extra={
                    "pod": f"{runtime.namespace}/{runtime.name}", "status": exc.status})

    async def _event(self, pod: dict[str, Any], reason: str, message: str, kind: str) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"],
                               "apiVersion": "v1"},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": "rota-node-agent", "host": self.node},
            "firstTimestamp": _now(), "lastTimestamp": _now(), "count": 1,
        }
        log.warning(reason, extra={"pod": f"{meta['namespace']}/{meta['name']}",
                                   "detail": message[:300]})
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, meta["namespace"], body,
                                    _request_timeout=_API_TIMEOUT)
        except client.ApiException:
            pass

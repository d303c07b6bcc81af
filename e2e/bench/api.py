"""Benchmark: what one node's lease controller asks of the API server.

    python -m e2e.bench.api [--seconds 60] [--unrelated-claims 10000]

A local cluster, one GPU node (driver, node agent, two simulated engines) and its lease
controller, whose kubeconfig points at a counting TLS proxy in front of the API server: so
every request the controller makes, and every byte it receives, is counted, and nothing
else is. Three phases, each ``--seconds`` long:

1. idle: the controller serves nothing;
2. steady switching: activations alternate between the two models as fast as they are
   answered (one client);
3. the same switching with ``--unrelated-claims`` ResourceClaims of no node in another
   namespace (created before the phase starts, not counted).

Prints, per phase, requests per minute (total and by ``verb resource``), bytes received
per minute, switches done and the controller's resident memory; a JSON object last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web
from kubernetes import client

from e2e.cluster import LocalCluster, pki
from e2e.cluster.local import free_port
from e2e.harness.local_node import GpuNode, engine_node
from e2e.harness.objects import claim, create_claim
from e2e.harness.scenario import EngineSpec, activate, deploy
from e2e.harness.waiting import eventually_async

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def request_kind(method: str, path_qs: str) -> str:
    """``"<verb> <resource>"`` of one API request, e.g. ``"list resourceclaims"``."""
    parts = urlsplit(path_qs)
    segments = [s for s in parts.path.split("/") if s]
    if segments[:1] == ["api"]:
        rest = segments[2:]
    elif segments[:1] == ["apis"]:
        rest = segments[3:]
    else:
        return f"{method.lower()} {parts.path}"
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    resource = rest[0] if rest else "(discovery)"
    named = len(rest) > 1
    query = parse_qs(parts.query)
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
    if verb is None:
        if query.get("watch", [""])[0] in ("true", "1"):
            verb = "watch"
        else:
            verb = "get" if named else "list"
    return f"{verb} {resource}"


@dataclass
class Tally:
    """Requests and bytes seen by the proxy since the last :meth:`reset`."""

    requests: Counter[str] = field(default_factory=Counter)
    received_bytes: int = 0

    def reset(self) -> None:
        self.requests = Counter()
        self.received_bytes = 0


class CountingProxy:
    """A TLS proxy to the API server that counts each request and the answer's bytes.

    It serves with the API server's own certificate (valid for 127.0.0.1) and forwards as
    the admin client certificate, streaming answers (watches) through as they come.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.tally = Tally()
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def pki(self) -> Path:
        return self.cluster.workdir / "pki"

    def write_kubeconfig(self, path: Path) -> Path:
        """The cluster's admin kubeconfig, reaching the API server through this proxy."""
        pki.write_kubeconfig(path, server=f"https://127.0.0.1:{self.port}",
                             pki=self.cluster.pki)
        return path

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        self.tally.requests[request_kind(request.method, request.path_qs)] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        async with self._session.request(request.method, self.cluster.server + request.path_qs,
                                         headers=headers, data=body or None,
                                         # the client may send none; aiohttp would add one
                                         skip_auto_headers=("Content-Type",)) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                self.tally.received_bytes += len(chunk)
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(self) -> None:
        upstream = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        upstream.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=upstream, limit=64),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        serving.load_cert_chain(str(self.pki / "apiserver.crt"),
                                str(self.pki / "apiserver.key"))
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=serving).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _unrelated_claims(api: client.ApiClient, count: int) -> str:
    """``count`` ResourceClaims that no pod uses, in a namespace of their own."""
    namespace = f"bench-unrelated-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    config_body = {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                   "model": "unrelated/model", "awakeMemory": "8Gi"}

    def one(index: int) -> None:
        create_claim(api, namespace, claim(f"unrelated-{index:05d}", memory="1Gi",
                                           config=config_body))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(count)))
    return namespace


async def _phase(name: str, seconds: float, proxy: CountingProxy, controller_pid: int,
                 load: Callable[[float], Any] | None) -> dict[str, Any]:
    proxy.tally.reset()
    began = time.monotonic()
    if isinstance(load, Load):
        load.failures.clear()
    switches = await load(began + seconds) if load is not None else 0
    if load is None:
        await asyncio.sleep(seconds)
    elapsed = time.monotonic() - began
    per_minute = 60.0 / elapsed
    requests = proxy.tally.requests
    return {
        "phase": name, "seconds": round(elapsed, 1), "switches": switches,
        "requests_per_minute": round(sum(requests.values()) * per_minute, 1),
        "received_bytes_per_minute": round(proxy.tally.received_bytes * per_minute),
        "by_kind_per_minute": {k: round(v * per_minute, 1)
                               for k, v in sorted(requests.items(), key=lambda kv: -kv[1])},
        "controller_rss_bytes": _rss_bytes(controller_pid),
        "failed_activations": dict(load.failures) if isinstance(load, Load) else {},
    }


@dataclass
class Load:
    """Activations alternating between two models, one at a time, until a deadline."""

    url: str
    models: tuple[str, str]
    failures: Counter[str] = field(default_factory=Counter)

    async def __call__(self, deadline: float) -> int:
        switches = 0
        async with aiohttp.ClientSession() as session:
            i = 0
            while (left := deadline - time.monotonic()) > 0:
                try:
                    status, body = await activate(session, self.url, self.models[i % 2],
                                                  timeout_s=max(left, 1.0))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.failures[type(exc).__name__] += 1
                    continue
                if status == 200 and body.get("switched"):
                    switches += 1
                elif status != 200:
                    self.failures[str(body.get("error", {}).get("type", status))] += 1
                i += 1
        return switches


async def _measure(node: GpuNode, api: client.ApiClient, namespace: str, proxy: CountingProxy,
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = [EngineSpec(f"engine-{x}", f"bench/model-{x}", resident="1Gi", awake="20Gi")
             for x in "ab"]
    await asyncio.to_thread(deploy, api, namespace, node.name, specs)
    kubeconfig = proxy.write_kubeconfig(node.dirs.root / "proxy.kubeconfig")
    controller = node.start_controller(extra=[f"--kubeconfig={kubeconfig}"])
    url = node.controller_url()
    models = (specs[0].model, specs[1].model)
    async with aiohttp.ClientSession() as session:
        async def serving() -> bool:
            status, _ = await activate(session, url, models[0], timeout_s=30)
            return status == 200

        try:
            await eventually_async(serving, timeout=90, what="controller serving")
        except AssertionError:
            print(controller.log_tail(), flush=True)
            raise
    load = Load(url, models)
    results = [await _phase("idle", args.seconds, proxy, controller.pid, None),
               await _phase("switching", args.seconds, proxy, controller.pid, load)]
    print(json.dumps(results[-1]), flush=True)
    if args.unrelated_claims:
        started = time.monotonic()
        await asyncio.to_thread(_unrelated_claims, api, args.unrelated_claims)
        print(f"created {args.unrelated_claims} unrelated claims in "
              f"{time.monotonic() - started:.0f} s", flush=True)
        results.append(await _phase(f"switching, {args.unrelated_claims} unrelated claims",
                                    args.seconds, proxy, controller.pid, load))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="length of each phase (default 60)")
    parser.add_argument("--unrelated-claims", type=int, default=10_000,
                        help="claims of no node created before the last phase (10000; 0: "
                             "skip that phase)")
    args = parser.parse_args(argv)
    cluster = LocalCluster()
    try:
        with cluster:
            api = cluster.api_client()
            try:
                with engine_node(cluster, api, prefix="bench") as (node, namespace):
                    async def run() -> list[dict[str, Any]]:
                        proxy = CountingProxy(cluster)
                        await proxy.start()
                        try:
                            return await _measure(node, api, namespace, proxy, args)
                        finally:
                            await proxy.stop()

                    results = asyncio.run(run())
            finally:
                api.close()
    finally:
        cluster.cleanup()
    for result in results:
        print(f"{result['phase']}: {result['requests_per_minute']} requests/min, "
              f"{result['received_bytes_per_minute'] / 1e6:.2f} MB/min received, "
              f"{result['switches']} switches "
              f"(failed activations: {result['failed_activations'] or 'none'}), controller RSS "
              f"{result['controller_rss_bytes'] / 2**20:.0f} MiB")
        for kind, rate in result["by_kind_per_minute"].items():
            print(f"    {rate:10.1f}/min  {kind}")
    print(json.dumps({"node_count": 1, "phases": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
